"""`python -m bench`: run every ddp-lab benchmark (the code lives in importable modules, which spawned processes need)."""

from bench.ddp import main

main()
