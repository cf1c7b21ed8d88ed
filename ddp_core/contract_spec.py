"""What a training experiment declares at module level, ``CONTRACT = ContractSpec(...)``, so that
``python -m tools.contract`` can check it (docs/new-experiment.md, section 5). Kept apart from the checker so that
declaring it imports nothing but this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ContractSpec:
    """The facts about an experiment that its flags alone do not say. The rest of the contract (the common
    flags, the run directory's files, ``loop.steps``) an experiment built on ``TrainingRun`` meets already."""

    model: Callable[[dict[str, Any]], Any]
    """The plain model (an ``nn.Module``, not wrapped in DDP), from the run's config (manifest.json's "config")."""
    brief: tuple[str, ...]
    """Flags for a run of a few seconds that ends normally and writes its final checkpoint."""
    stop_at_step: int
    """An optimizer step inside the brief run: ``--stop-at-step`` there, then ``--resume``, must end bitwise-equal."""
    long: tuple[str, ...]
    """Flags for a run that writes a checkpoint early and lasts until a stop signal (SIGTERM) ends it."""
    world_size_invariant: bool = False
    """True if 1 and 2 processes with the same global batch end within float32 rounding of each other."""
    batch_flag: str = "--batch-size"
    """The per-process batch option: the 1-process run gets twice ``batch_size`` (the same global batch)."""
    batch_size: int = 8
    """Per-process batch of the multi-process runs."""
