"""An experiment that also logs two warnings on every rank, for tests/e2e/test_printed_once.py.

    torchrun ... -m tests.e2e.warning_probe experiments.toy [flags]

At its first optimizer step every rank logs ALIKE, a warning every rank gives alike (as DDP's bucket warning or
the GradScaler's), and OWN, one about this rank alone (marked ``extra=THIS_RANK``, as the CUDA RNG warning),
through the run's logging; then the experiment trains on. Test code only: the experiments have no such hook.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

import torch

from ddp_core.ranks import THIS_RANK

ALIKE = "a warning every rank gives alike"
OWN = "rank {rank}'s own warning"


def warn_at_the_first_step() -> None:
    original_step = torch.optim.SGD.step
    warned = False

    def step(self, *args, **kwargs):
        nonlocal warned
        if not warned:
            warned = True
            log = logging.getLogger(__name__)
            log.warning(ALIKE)
            log.warning(OWN.format(rank=os.environ.get("RANK", "0")), extra=THIS_RANK)
        return original_step(self, *args, **kwargs)

    torch.optim.SGD.step = step


if __name__ == "__main__":
    warn_at_the_first_step()
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
