"""Run an experiment with one rank's replica perturbed after an optimizer step, as a faulty GPU or a skipped
update would leave it:

    torchrun ... -m tests.e2e.perturbed_replica experiments.toy [flags]
    (PERTURB_RANK=2 PERTURB_STEP=6 PERTURB_NAME=net2.bias)

After step PERTURB_STEP, rank PERTURB_RANK adds 1e-3 to the first element of the parameter PERTURB_NAME.
The negative control of the replica check (ddp_core.training.replicas). Test code only.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from ddp_core.lifecycle.loop import TrainingLoop

stepping = TrainingLoop.step


def perturbed_step(self: TrainingLoop, lr: float | None = None) -> bool:
    if self.ctx.rank == int(os.environ["PERTURB_RANK"]) and self.position.step + 1 == int(os.environ["PERTURB_STEP"]):
        with torch.no_grad():
            dict(self.model.module.named_parameters())[os.environ["PERTURB_NAME"]].view(-1)[0] += 1e-3
    return stepping(self, lr)


if __name__ == "__main__":
    TrainingLoop.step = perturbed_step  # type: ignore[method-assign]
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
