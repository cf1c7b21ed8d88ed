"""Run an experiment with its resume broken on purpose: a resumed epoch restarts from its first batch.

    torchrun ... -m tests.e2e.broken_resume experiments.cifar10 [flags]

The negative control for the bitwise resume tests: they must notice this. Test code only.
"""

from __future__ import annotations

import runpy
import sys

from ddp_core.samplers import TrainSampler

original_set_epoch = TrainSampler.set_epoch


def set_epoch_from_the_first_batch(self: TrainSampler, epoch: int, start: int = 0) -> None:
    original_set_epoch(self, epoch, 0)


if __name__ == "__main__":
    TrainSampler.set_epoch = set_epoch_from_the_first_batch
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
