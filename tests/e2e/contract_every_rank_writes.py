"""The toy with DDP's most common output trap: every rank writes its own log file into the run directory.

    python -m tools.contract tests.e2e.contract_every_rank_writes    # must FAIL rank-zero-writes

A negative control for tools.contract. Test code only.
"""

from __future__ import annotations

import experiments.toy as toy
from ddp_core.distributed.group import rank
from ddp_core.output.run import RunDir

CONTRACT = toy.CONTRACT
create = RunDir.create


def create_and_log_from_every_rank(self: RunDir) -> None:
    create(self)  # collective: the run directory exists on every rank once it returns
    (self.dir / f"log_rank{rank()}.txt").write_text("the mistake: one file per rank in the run directory\n")


if __name__ == "__main__":
    RunDir.create = create_and_log_from_every_rank
    toy.main.run_and_exit()
