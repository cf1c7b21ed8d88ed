"""Run an experiment with its resume broken on purpose, in one of two ways (BROKEN_RESUME):

    torchrun ... -m tests.e2e.broken_resume experiments.cifar10 [flags]

- `epoch_start` (the default): a resumed epoch restarts from its first batch.
- `bucket_layout`: the resume does not replay its first step to settle DDP's gradient buckets
  (ddp_core.training.buckets), so that step reduces with DDP's first-iteration bucket layout.
- `hook_state`: the communication hook's state (PowerSGD's error feedback, warm start, step) is saved but not
  put back on resume, as when a hook's state is not checkpointed.

The negative controls for the bitwise resume tests: they must notice these. Test code only.
"""

from __future__ import annotations

import os
import runpy
import sys

import ddp_core.lifecycle.checkpointer
from ddp_core.training.comm import CommHook
from ddp_core.training.samplers import TrainSampler

original_set_epoch = TrainSampler.set_epoch


def set_epoch_from_the_first_batch(self: TrainSampler, epoch: int, consumed: int = 0) -> None:
    original_set_epoch(self, epoch, 0)


def keep_the_first_bucket_layout(*args: object, **kwargs: object) -> bool:
    return False


if __name__ == "__main__":
    broken = os.environ.get("BROKEN_RESUME", "epoch_start")
    if broken == "epoch_start":
        TrainSampler.set_epoch = set_epoch_from_the_first_batch
    elif broken == "hook_state":
        CommHook.load_state_dict = lambda self, saved: None
    else:
        ddp_core.lifecycle.checkpointer.rebuilds_buckets = (
            keep_the_first_bucket_layout  # where it is looked up: no replay
        )
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
