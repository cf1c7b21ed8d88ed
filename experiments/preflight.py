"""Preflight: check a whole (multi-node) job before the real run; the tool lives in tools/preflight/."""

from tools.preflight.main import main

KIND = "tool"

if __name__ == "__main__":
    main.run_and_exit()
