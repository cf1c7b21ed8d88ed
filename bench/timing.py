"""Clock helpers shared by the benchmarks."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (no-op on CPU).

    CUDA calls return as soon as the work is queued: a clock read without this measures the launches,
    and the GPU time spills into whatever is timed next.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
