"""The checkpointer without a run: ``Checkpointer`` over a stand-in for the run directory, so tests save and restore
a model, an optimizer and the position through the same named states a run does (a world of one, or a process
group's). Test code only."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ddp_core.distributed.group import rank, world_size
from ddp_core.lifecycle.checkpointer import Checkpointer, CheckpointerArgs, Recorded, Trained
from ddp_core.lifecycle.position import Position
from ddp_core.output.checkpoint import CheckpointDir, atomic_write, checkpoint_file
from ddp_core.training.comm import CommHook


class StandInRun:
    """The two calls the checkpointer makes of a run directory: written into ``directory`` (a CheckpointDir), or
    kept as ``written``; read back from ``checkpoint``."""

    def __init__(self, directory: Path | None = None, checkpoint: dict[str, Any] | None = None) -> None:
        self.ctx = SimpleNamespace(rank=rank())
        self.directory, self.checkpoint = directory, checkpoint
        self.written: dict[str, Any] | None = None

    def save_checkpoint(self, step: int, states: Any, about: dict[str, Any] | None = None) -> None:
        if self.directory is not None:
            CheckpointDir(self.directory).save(step, states, about)
        else:
            self.written = checkpoint_file(step, states(), about)

    def load_checkpoint(self) -> tuple[dict[str, Any], Path]:
        assert self.checkpoint is not None
        return self.checkpoint, Path("checkpoint.pt")


def checkpointer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    run: StandInRun,
    step: int = 0,
    epoch: int = 0,
    other_world: bool = False,
) -> Checkpointer:
    """The run's checkpointer over these parts; ``other_world``: a resume may continue at another world size."""
    position = Position(steps_per_epoch=10**6, samples_per_step=1, step=step, epoch=epoch)
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    return Checkpointer(
        run,  # type: ignore[arg-type]
        Recorded("toy", {"seed": 0}, seed=0, other_world=other_world),
        CheckpointerArgs(),
        Trained(model, optimizer, None, CommHook("none")),
        position,
        per_epoch=False,
    )


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, epoch: int
) -> None:
    """One file at ``path`` holding what a run's checkpoint at ``step`` holds for these parts (a world of one)."""
    run = StandInRun()
    checkpointer(model, optimizer, run, step, epoch).save(step)
    atomic_write(path, lambda handle: torch.save(run.written, handle))


def restore(checkpoint: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """Every state of ``checkpoint`` put back into these parts, as a resume does; returns (step, epoch)."""
    parts = checkpointer(model, optimizer, StandInRun(checkpoint=checkpoint))
    parts.resume(world_size(), rank(), on_undo=lambda: None)
    return parts.position.step, parts.position.epoch
