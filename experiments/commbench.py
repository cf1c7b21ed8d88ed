"""Collective-communication benchmark in the manner of nccl-tests; the tool lives in tools/commbench.py."""

from tools.commbench import main

KIND = "tool"

if __name__ == "__main__":
    from ddp_core.process.exit import run_and_exit  # the script path only: tests call main() in-process

    run_and_exit(main)
