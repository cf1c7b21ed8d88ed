"""The stop policy: why a run ends before its last planned step, decided alike on every rank at the same step.

- a stop signal (SIGTERM, Ctrl-C) any rank got: asked every step on CPU, once per log interval and at an
  epoch's end on CUDA (asking syncs the GPU); the run checkpoints and exits 143 (``process/preemption.py``);
- ``--stop-at-step``: the run checkpoints there and ends without metrics.json;
- a non-finite loss or weight (``training/guard.py``, exit 3), checked before anything is logged or saved;
- replicas that differ (``training/replicas.py``, exit 5), every ``--check-replicas-every`` steps and before
  every checkpoint, so that a checkpoint always holds agreeing replicas.

A new stop reason is a ``RunStoppedError`` subclass with its own code in ``exit_codes.py``, raised here on
every rank at the same step.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddp_core.config import with_role
from ddp_core.output.checkpoint import CheckpointArgs
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.guard import NonFiniteGuard
from ddp_core.training.replicas import ReplicaCheck


class StopPolicy:
    def __init__(self, signals: GracefulStop, args: CheckpointArgs, model: nn.Module, device: torch.device) -> None:
        self.signals, self.stop_at_step, self.device = signals, args.stop_at_step, device
        lr = with_role(args, "lr")
        self.guard = NonFiniteGuard(
            device, advice=f"a lower {lr[0]} (now {lr[1]:g})" if lr else "a lower learning rate"
        )
        self.replicas, self.replicas_every = ReplicaCheck(model, device), args.check_replicas_every

    def resumed_at(self, step: int) -> None:
        self.replicas.last_agreed = step  # a checkpoint holds agreeing replicas

    def observe(self, loss: torch.Tensor, step: int) -> None:
        self.guard.observe(loss, step)  # device arithmetic: no host read per step

    def stops_at(self, step: int, *, ask_signals: bool) -> bool:
        """Whether the run stops early after ``step`` (not its last): a collective when ``ask_signals``."""
        return step == self.stop_at_step or (ask_signals and self.signals.requested())

    def replicas_due(self, step: int, saving: bool) -> bool:
        return bool(self.replicas_every) and (saving or step % self.replicas_every == 0)

    def check(self, step: int, weights: nn.Module | None, compare: bool, checkpoint: Path) -> None:
        """Collective, before anything of ``step`` is logged, evaluated or saved: the guard's verdict (with
        ``weights``' values, before a save or an evaluation) and, when ``compare``, the replica check."""
        self.guard.check(step, weights, checkpoint)
        if compare:
            self.replicas.check(step, checkpoint)

    def report(self, step: int, run_dir: Path, total_steps: int) -> None:
        self.signals.report(step, run_dir, total_steps)  # every rank; exit 143 after a signal
