"""``python -m tools.preflight``: the preflight (tools.preflight.main), as ``-m experiments.preflight`` runs it."""

from tools.preflight.main import main

if __name__ == "__main__":
    main.run_and_exit()
