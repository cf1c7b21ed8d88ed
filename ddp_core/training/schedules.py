"""Learning-rate schedules as pure functions of the step: nothing to save, so a resume is exact by construction."""

from __future__ import annotations

import math

import torch

SCHEDULES = ("onecycle", "cosine")


def lr_at(
    step: int,
    total_steps: int,
    peak_lr: float,
    warmup_steps: int = 0,
    schedule: str = "onecycle",
    final_fraction: float = 0.0,
) -> float:
    """The learning rate for optimizer step ``step`` (0-based): linear warm-up to ``peak_lr``, then down to
    ``peak_lr * final_fraction`` at ``total_steps``, linearly (``onecycle``, airbench's) or along a half cosine."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    shape = 1.0 - progress if schedule == "onecycle" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak_lr * (final_fraction + (1.0 - final_fraction) * shape)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Every parameter group's learning rate to ``lr`` (a schedule's value for this step); returns ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
