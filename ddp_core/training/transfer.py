"""Host values to the device without making the host wait for the GPU.

A copy from pageable host memory to a GPU synchronizes: the host waits until the GPU has run everything queued
before it. From pinned memory the copy is queued like a kernel. Where the loop must not wait (every step's batch
indices, a log point's figures read late), host values go through pinned memory.
"""

from __future__ import annotations

import torch


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (on the host) on ``device``: on CUDA through pinned memory, queued behind the stream's work."""
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)
