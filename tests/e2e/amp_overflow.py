"""An experiment whose GradScaler starts at a loss scale that overflows float16 gradients, so its first
steps are skipped for real, as a GPU without bf16 would skip them now and then.

    torchrun ... -m tests.e2e.amp_overflow experiments.cifar10 --amp --amp-dtype fp16 [flags]

Test code only: the experiment has no hook for it; the default ``init_scale`` of ``torch.amp.GradScaler``
is raised before the experiment builds its scaler (AMP_INIT_SCALE, default 2**24).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

import torch

INIT_SCALE = float(os.environ.get("AMP_INIT_SCALE", 2.0**24))

torch.amp.GradScaler.__init__ = functools.partialmethod(torch.amp.GradScaler.__init__, init_scale=INIT_SCALE)  # type: ignore[method-assign]

if __name__ == "__main__":
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
