"""An experiment whose GradScaler starts at a loss scale that overflows float16 gradients, so its first
steps are skipped for real, as a GPU without bf16 would skip them now and then.

    torchrun ... -m tests.e2e.amp_overflow experiments.cifar10 --amp --amp-dtype fp16 [flags]

Test code only: the experiment has no hook for it; the default ``init_scale`` of ``torch.amp.GradScaler``
is raised before the experiment builds its scaler (AMP_INIT_SCALE, default 2**24).

With AMP_CONV_FREE=1, ``--model small`` is a network without convolutions (flatten, linear, batch norm,
linear): float16 convolutions have no fast backward on CPU (16 s per step of the small CNN at batch 32
against 0.1 s in float32), linear layers do. Everything the scaler path touches (skipped steps, the
scale and its checkpoint, the resume, synchronized batch norm) is the same; the small CNN trains in
float16 on GPUs (tests/gpu).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

import torch
from torch import nn

from experiments import cifar10_models

INIT_SCALE = float(os.environ.get("AMP_INIT_SCALE", 2.0**24))

torch.amp.GradScaler.__init__ = functools.partialmethod(torch.amp.GradScaler.__init__, init_scale=INIT_SCALE)  # type: ignore[method-assign]


def conv_free(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, num_classes)
    )


if os.environ.get("AMP_CONV_FREE") == "1":
    real_build = cifar10_models.build_model
    cifar10_models.build_model = lambda name, num_classes=10: (
        conv_free(num_classes) if name == "small" else real_build(name, num_classes)
    )

if __name__ == "__main__":
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
