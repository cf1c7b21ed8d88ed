"""The stop policy: why a run ends before its last planned step, decided alike on every rank at the same step: a
stop signal (exit 143; on CUDA told with a log point's figures read late), ``--stop-at-step``, a non-finite loss or
weight (``training/guard.py``, exit 3), replicas that differ (``training/replicas.py``, exit 5; checked before every
checkpoint too). A new stop reason is a ``RunStoppedError`` subclass with its own code in ``exit_codes.py``, raised
here on every rank at the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddp_core.config import option
from ddp_core.lifecycle.log_point import LogPoint, LogRow
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.guard import NonFiniteGuard
from ddp_core.training.replicas import ReplicaCheck

# One all_gather of 16 bytes per tensor; measured in docs/benchmarks.md ("Replica check").
REPLICA_CHECK_EVERY = 100


@dataclass
class StopPolicyArgs:
    """The stop policy's options: where the run stops early, how often the replicas are compared."""

    stop_at_step: int = option(
        0,
        "checkpoint and stop at this optimizer step, keeping the schedule of the whole run (no metrics.json: "
        "the run has not ended); continue later with --resume (0: train to the end)",
        minimum=0,
        computation=False,
    )
    check_replicas_every: int = option(
        REPLICA_CHECK_EVERY,
        "every N optimizer steps, and before every checkpoint, check that every rank "
        "holds the same parameters and buffers; exit 5 naming the first that differs (0: off)",
        minimum=0,
        note="0 turns the check off",
        computation=False,
    )


class StopPolicy:
    def __init__(self, signals: GracefulStop, options: StopPolicyArgs, model: nn.Module, device: torch.device) -> None:
        self.signals, self.stop_at_step, self.device = signals, options.stop_at_step, device
        self.guard = NonFiniteGuard(device)
        self.replicas, self.replicas_every = ReplicaCheck(model, device), options.check_replicas_every

    def resumed_at(self, step: int) -> None:
        self.replicas.last_agreed = step  # a checkpoint holds agreeing replicas

    def observe(self, loss: torch.Tensor, step: int) -> None:
        self.guard.observe(loss, step)  # a copy on the device: no host read per step

    def stop_planned(self, step: int) -> bool:
        """--stop-at-step: the run stops after ``step``, whatever the signals say."""
        return step == self.stop_at_step

    def stops_at(self, step: int, *, ask_signals: bool, signalled: bool = False) -> bool:
        """Whether the run stops early after ``step`` (not its last): a collective when ``ask_signals``;
        ``signalled``: a log point's late figures said a rank got a signal (every rank read the same)."""
        if signalled:
            self.signals.agree(True)
        return step == self.stop_at_step or signalled or (ask_signals and self.signals.requested())

    def fill(self, point: LogPoint) -> None:
        """This rank's part of a log point read late (``late_reads.py``): the guard's verdict on the device (no
        host read), and whether this rank got a stop signal."""
        point.verdict, point.signal = self.guard.local_row(), self.signals.received is not None

    def judge_late(self, rows: list[LogRow], step: int, kept: Callable[[], Path], lr: float) -> bool:
        """A log point read late, every rank's figures: raises DivergedError at ``step`` on the guard's verdict;
        returns whether any rank got a stop signal."""
        self.guard.judge([row.verdict for row in rows if row.verdict is not None], step, kept, advice=_advice(step, lr))
        return any(row.signal for row in rows)

    def replicas_due(self, step: int, saving: bool) -> bool:
        return bool(self.replicas_every) and (saving or step % self.replicas_every == 0)

    def check(self, step: int, weights: nn.Module | None, compare: bool, kept: Callable[[], Path], lr: float) -> None:
        """Collective, before anything of ``step`` is logged, evaluated or saved: the guard's verdict (with
        ``weights``' values, before a save or an evaluation; its advice names ``lr``, the step's learning rate)
        and, when ``compare``, the replica check. ``kept`` (a collective) gives the checkpoint a stop names."""
        self.guard.check(step, weights, kept, advice=_advice(step, lr))
        if compare:
            self.replicas.check(step, kept)

    def report(self, step: int, run_dir: Path, total_steps: int) -> None:
        self.signals.report(step, run_dir, total_steps)  # every rank; exit 143 after a signal


def _advice(step: int, lr: float) -> str:
    return f"a lower learning rate (step {step}'s was {lr:g})"
