"""The run's shape, made once by ``TrainingRun.plan``: its length, its epochs, its global batch, its evaluation.

The plan is also the next phase: ``plan.resume_or_start(model, optimizer)`` puts a checkpoint back (or starts
fresh) and returns the loop (``loop.py``) the experiment drives: the loop is the plan's type parameter, so that
this module, which the loop reads, imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from ddp_core.config import option
from ddp_core.errors import AgreedConfigError
from ddp_core.training.profiling import Window


class Evaluation(Protocol):
    """What an experiment's evaluation may return beside a plain dict: a result that names its metrics."""

    def as_metrics(self) -> dict[str, float]: ...


# The run's evaluation: called with the step it follows and the run's TensorBoard writer (rank 0 writes), for
# what it logs itself beside the metrics it returns.
Evaluate = Callable[[int, Any], "dict[str, float] | Evaluation"]


@dataclass
class StepsArgs:
    """A run whose length the user gives in optimizer steps (``plan(total_steps=args.steps)``); --stop-at-step is
    checked against it before any process starts. A run counted in epochs declares its own --epochs."""

    steps: int = option(300, "optimizer steps to train for, counting those before a resume", minimum=1)


Loop = TypeVar("Loop")  # what the plan starts: TrainingLoop
Start = Callable[["Plan[Loop]", nn.Module, torch.optim.Optimizer, "torch.amp.GradScaler | None"], Loop]


@dataclass(frozen=True)
class Plan(Generic[Loop]):
    total_steps: int
    steps_per_epoch: int  # optimizer steps; a run counted in steps alone has one epoch of total_steps
    samples_per_step: int  # the global batch: per-process batch x processes x micro-batches
    grad_accum: int = 1  # micro-batches per optimizer step
    per_epoch: bool = False  # evaluate and checkpoint at each epoch's end
    evaluate: Evaluate | None = None
    unit: str = "samples"
    start: Start[Loop] | None = field(default=None, compare=False, repr=False)  # the run that made it: how it starts

    def scaled_lr(self, base_lr: float, reference_batch: int = 256) -> float:
        """``base_lr``, given for a global batch of ``reference_batch``, scaled linearly to this run's global batch
        (per-process batch x processes x --grad-accum): the same schedule at any world size."""
        return base_lr * self.samples_per_step / reference_batch

    def resume_or_start(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: torch.amp.GradScaler | None = None
    ) -> Loop:
        """Resuming: the checkpoint's model, optimizer, scaler, position and every rank's random streams (bitwise at
        the same world size; ``checkpointer.py``). Starting: each rank's own random streams. Returns the loop; under
        --zero its ``optimizer`` is the ZeroRedundancyOptimizer around ``optimizer``: step that one."""
        if self.start is None:
            raise RuntimeError("this plan was not made by TrainingRun.plan(...): it cannot start a run")
        return self.start(self, model, optimizer, scaler)


def make_plan(
    loader: Any,
    *,
    total_steps: int | None,
    epochs: int | None,
    steps_per_epoch: int | None,
    batch_size: int | None,
    world_size: int,
    grad_accum: int,
    per_epoch: bool,
    evaluate: Evaluate | None,
    unit: str,
    stop_at_step: int,
    eval_every: int,
    start: Start[Loop] | None = None,
    profile: str = "",
) -> Plan[Loop]:
    """The plan, or the one-line error every rank reaches alike from the same numbers (printed by rank 0): every
    value judged against the run's length is judged here, before the run directory is made."""
    if (total_steps is None) == (epochs is None):
        raise TypeError("TrainingRun.plan needs one of total_steps= (optimizer steps) or epochs=")
    if steps_per_epoch is None:
        if loader is None and epochs is not None:
            raise TypeError("TrainingRun.plan(epochs=...) needs a loader or steps_per_epoch=")
        steps_per_epoch = len(loader) // grad_accum if loader is not None else total_steps
    if batch_size is None:
        if loader is None or getattr(loader, "batch_size", None) is None:
            raise TypeError("TrainingRun.plan needs batch_size= (samples per process per micro-batch) or a loader")
        batch_size = int(loader.batch_size)
    if steps_per_epoch <= 0:
        accumulation = f", --grad-accum={grad_accum}" if grad_accum > 1 else ""
        raise AgreedConfigError(
            f"each of {world_size} processes gets fewer samples than one step needs (--batch-size={batch_size}"
            f"{accumulation}): lower them or use more data"
        )
    if total_steps is None:
        total_steps = epochs * steps_per_epoch
    if stop_at_step > total_steps:
        raise AgreedConfigError(
            f"--stop-at-step={stop_at_step} is beyond the run's {total_steps} steps: it must be at most that "
            "(0: train to the end)"
        )
    window = Window.parse(profile)
    if window is not None and window.first > total_steps:
        raise AgreedConfigError(
            f"--profile={window} starts beyond the run's {total_steps} steps: START must be at most that"
        )
    if eval_every and evaluate is None:
        raise AgreedConfigError(f"--eval-every={eval_every}: this experiment has no evaluation; drop the flag")
    global_batch = batch_size * world_size * grad_accum
    return Plan(total_steps, steps_per_epoch, global_batch, grad_accum, per_epoch, evaluate, unit, start)
