"""Preflight: check a whole (multi-node) job before the real run; the tool lives in tools/preflight/."""

from tools.preflight.main import main

KIND = "tool"

if __name__ == "__main__":
    from ddp_core.process.exit import run_and_exit  # the script path only: tests call main() in-process

    run_and_exit(main)
