"""Optimizer parameter groups shared by the experiments."""

from __future__ import annotations

from typing import Any

from torch import nn


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: matrices and kernels decayed, 1-D tensors (biases, norm weights) not: decaying them
    only hurts. Frozen parameters are left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
