"""Run an experiment with one rank's replica perturbed after an optimizer step, as a faulty GPU or a skipped
update would leave it, optionally on a slow disk:

    torchrun ... -m bench.perturbed_replica experiments.toy [flags]
    (PERTURB_RANK=2 PERTURB_STEP=6 PERTURB_NAME=net2.bias [SLOW_WRITE_S=2])

After step PERTURB_STEP, rank PERTURB_RANK adds 1e-3 to the first element of the parameter PERTURB_NAME.
SLOW_WRITE_S makes each checkpoint file take that many seconds more to write (a slow disk: the write in flight
when the replica check stops the run). The negative control of the replica check (ddp_core.training.replicas),
used by its end-to-end test and by ``python -m bench.stress --launcher diverged``.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddp_core.lifecycle.loop import TrainingLoop
from ddp_core.output.checkpoint import CheckpointDir

stepping = TrainingLoop.step
writing = CheckpointDir.write


def perturbed_step(self: TrainingLoop, lr: float | None = None) -> bool:
    if self.ctx.rank == int(os.environ["PERTURB_RANK"]) and self.position.step + 1 == int(os.environ["PERTURB_STEP"]):
        with torch.no_grad():
            dict(self.model.module.named_parameters())[os.environ["PERTURB_NAME"]].view(-1)[0] += 1e-3
    return stepping(self, lr)


def slow_write(self: CheckpointDir, path: Path, state: dict[str, Any]) -> None:
    time.sleep(float(os.environ["SLOW_WRITE_S"]))  # the fault injected: a disk this slow, not a synchronisation
    writing(self, path, state)


if __name__ == "__main__":
    TrainingLoop.step = perturbed_step  # type: ignore[method-assign]
    if float(os.environ.get("SLOW_WRITE_S", "0")) > 0:
        CheckpointDir.write = slow_write  # type: ignore[method-assign]
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
