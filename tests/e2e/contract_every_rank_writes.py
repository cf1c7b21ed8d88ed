"""The toy with DDP's most common output trap: every rank writes its own log file into the run directory.

    python -m tools.contract tests.e2e.contract_every_rank_writes    # must FAIL rank-zero-writes

A negative control for tools.contract. Test code only.
"""

from __future__ import annotations

import experiments.toy as toy
from ddp_core import experiment
from ddp_core.distributed.group import rank

CONTRACT = toy.CONTRACT
start_run = experiment.start_run


def start_run_and_log_from_every_rank(*args, **kwargs):
    run = start_run(*args, **kwargs)
    (run.dir / f"log_rank{rank()}.txt").write_text("the mistake: one file per rank in the run directory\n")
    return run


if __name__ == "__main__":
    experiment.start_run = start_run_and_log_from_every_rank
    toy.main.run_and_exit()
