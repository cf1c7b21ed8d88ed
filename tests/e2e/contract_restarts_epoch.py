"""The toy whose sampler forgets where the epoch stopped: a resumed epoch starts again from its first batch,
as a plain DistributedSampler (or a set_epoch without ``consumed``) does.

    python -m tools.contract tests.e2e.contract_restarts_epoch --only resume    # must FAIL resume

A negative control for tools.contract: its line must name the sampler. Test code only.
"""

from __future__ import annotations

import experiments.toy as toy
from ddp_core.training.samplers import TrainSampler

CONTRACT = toy.CONTRACT
original_set_epoch = TrainSampler.set_epoch


def set_epoch_from_its_start(self: TrainSampler, epoch: int, consumed: int = 0) -> None:
    original_set_epoch(self, epoch)  # the mistake: the samples the stopped run already trained on are dealt again


if __name__ == "__main__":
    TrainSampler.set_epoch = set_epoch_from_its_start
    toy.main.run_and_exit()
