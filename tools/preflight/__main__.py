"""``python -m tools.preflight``: the preflight (tools.preflight.main), as ``-m experiments.preflight`` runs it."""

from ddp_core.process.exit import run_and_exit
from tools.preflight.main import main

if __name__ == "__main__":
    run_and_exit(main)  # a finished worker leaves before gloo's teardown can abort it (docs/design.md, "Gloo teardown")
