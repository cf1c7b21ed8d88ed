"""Collective-communication benchmark in the manner of nccl-tests; the tool lives in tools/commbench.py."""

from tools.commbench import main

KIND = "tool"

if __name__ == "__main__":
    main.run_and_exit()
