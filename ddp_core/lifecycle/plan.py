"""The run's shape, set once by ``TrainingRun.plan``: its length, its epochs, its global batch, its evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ddp_core.errors import AgreedConfigError


class Evaluation(Protocol):
    """What an experiment's evaluation may return beside a plain dict: a result that names its metrics."""

    def as_metrics(self) -> dict[str, float]: ...


Evaluate = Callable[[], "dict[str, float] | Evaluation"]


@dataclass(frozen=True)
class Plan:
    total_steps: int
    steps_per_epoch: int  # optimizer steps; a run counted in steps alone has one epoch of total_steps
    samples_per_step: int  # the global batch: per-process batch x processes x micro-batches
    grad_accum: int = 1
    per_epoch: bool = False  # evaluate and checkpoint at each epoch's end
    evaluate: Evaluate | None = None
    unit: str = "samples"


def make_plan(
    loader: Any,
    *,
    total_steps: int,
    steps_per_epoch: int | None,
    batch_size: int | None,
    world_size: int,
    grad_accum: int,
    per_epoch: bool,
    evaluate: Evaluate | None,
    unit: str,
    stop_at_step: int,
    eval_every: int,
) -> Plan:
    """The plan, or the one-line error every rank reaches alike from the same numbers (printed by rank 0)."""
    if steps_per_epoch is None:
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
    if stop_at_step > total_steps:
        raise AgreedConfigError(
            f"--stop-at-step={stop_at_step} is beyond the run's {total_steps} steps: it must be at most that "
            "(0: train to the end)"
        )
    if eval_every and evaluate is None:
        raise AgreedConfigError(f"--eval-every={eval_every}: this experiment has no evaluation; drop the flag")
    return Plan(
        total_steps, steps_per_epoch, batch_size * world_size * grad_accum, grad_accum, per_epoch, evaluate, unit
    )
