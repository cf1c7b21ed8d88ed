"""Stop a diverging run on every rank at the same step, before a non-finite value reaches a checkpoint.

Each step's loss is copied into a device buffer (one kernel, no host read); ``check``, a collective where the loop
synchronizes anyway (a log point, before every checkpoint, the end), finds the earliest non-finite loss of any rank,
and a non-finite weight or buffer, and every rank raises ``DivergedError`` together (docs/decisions.md, "Stopping,
diverging, disagreeing"). Read late, ``local_row`` is the rank's part of a log point and ``judge`` the verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.errors import RunStoppedError
from ddp_core.exit_codes import DIVERGED_EXIT_CODE
from ddp_core.training.transfer import upload

_NO_STEP = -1.0
LOSSES_PER_BUFFER = 256  # losses per device buffer; a run with more steps between two checks gets another buffer


class Verdict(NamedTuple):
    """One rank's ``local_row``, read on the host."""

    first_bad_step: float  # the first step since the last row whose loss was not finite (``_NO_STEP``: none)
    loss: float  # that step's loss
    weights_bad: float  # 1.0: the model held a non-finite weight or buffer


VERDICT_COLUMNS = len(Verdict._fields)  # a verdict's slots in a log point's row (``lifecycle/log_point.py``)


class DivergedError(RunStoppedError):
    """The loss or the model became non-finite; the message names the step, the value and what to try."""

    exit_code = DIVERGED_EXIT_CODE


class NonFiniteGuard:
    """Watches the training loss on the device; ``check`` is where every rank agrees on the verdict."""

    def __init__(self, device: torch.device, advice: str = "") -> None:
        self.device = device
        self.advice = advice
        self._buffers: list[torch.Tensor] = []  # float64: every loss dtype converts exactly, inf and nan kept
        self._steps: list[int] = []  # the step of each loss observed since the last check

    def observe(self, loss: torch.Tensor, step: int) -> None:
        """Keep ``loss`` (of step ``step``) for the next check: one copy on the device, no host read."""
        buffer, slot = divmod(len(self._steps), LOSSES_PER_BUFFER)
        if buffer == len(self._buffers):
            self._buffers.append(torch.empty(LOSSES_PER_BUFFER, dtype=torch.float64, device=self.device))
        self._buffers[buffer][slot].copy_(loss.detach())
        self._steps.append(step)

    def _first_bad(self) -> torch.Tensor:
        """``[step, loss]`` of the first non-finite loss observed since the last check, on the device (step
        ``_NO_STEP`` where every one was finite), and forgets them: the buffers fill again from their start."""
        steps, self._steps = self._steps, []
        if not steps:  # through pinned memory: a log point read late must not wait for the GPU
            return upload(torch.tensor([_NO_STEP, 0.0], dtype=torch.float64), self.device)
        losses = torch.cat(self._buffers)[: len(steps)]
        bad = ~torch.isfinite(losses)
        first = bad.to(torch.int32).argmax().reshape(1)  # argmax names the first of equal maxima
        # index_select, not [first]: a kernel, whatever indexing with a device tensor does on the host
        step = upload(torch.tensor(steps, dtype=torch.float64), self.device).index_select(0, first)
        return torch.cat([torch.where(bad.any(), step, _NO_STEP), losses.index_select(0, first)])

    def local_row(self, model: nn.Module | None = None) -> torch.Tensor:
        """This rank's verdict on the device, no host read: ``[first bad step, its loss, model non-finite]``
        (the step ``_NO_STEP`` where every loss since the last row was finite); forgets the losses."""
        weights_bad = torch.zeros((), dtype=torch.float64, device=self.device)
        if model is not None:
            tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
            if tensors:
                finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
                weights_bad = finite.logical_not().to(torch.float64)
        return torch.cat([self._first_bad(), weights_bad.reshape(1)])

    def check(
        self, step: int, model: nn.Module | None = None, kept: Callable[[], Path] | None = None, advice: str = ""
    ) -> None:
        """Collective. Raises DivergedError on every rank if any rank saw a non-finite loss, or if ``model``
        holds a non-finite parameter or buffer. Pass ``model`` right before a checkpoint is written; ``kept``,
        called by every rank only when it raises, gives the last good checkpoint once on disk (named where it
        exists); ``advice`` (else the guard's own) says what to try."""
        local = self.local_row(model)
        rows = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, local)
        table = [Verdict(*row) for row in torch.stack(rows).cpu().tolist()]  # the one host read: a sync point anyway
        self.judge(table, step, kept, advice)

    def judge(self, table: list[Verdict], step: int, kept: Callable[[], Path] | None = None, advice: str = "") -> None:
        """Every rank's verdict, in rank order: raises DivergedError as ``check`` says (every rank judges the same
        table at the same step)."""
        bad_losses = [(v.first_bad_step, v.loss, rank) for rank, v in enumerate(table) if v.first_bad_step != _NO_STEP]
        bad_weights = [rank for rank, verdict in enumerate(table) if verdict.weights_bad]
        if not bad_losses and not bad_weights:
            return
        if bad_losses:
            first_step, value, rank = min(bad_losses)
            what = f"the training loss became {value} at step {int(first_step)} (rank {rank})"
        else:
            rank = bad_weights[0]
            what = f"the model holds non-finite weights after step {step} (rank {rank}), though every loss was finite"
        checkpoint = kept() if kept is not None else None
        good = checkpoint is not None and checkpoint.is_file()
        back = f"the last good checkpoint is {checkpoint}" if good else "no checkpoint had been written yet"
        raise DivergedError(
            f"{what}; stopped at step {step} with no checkpoint written since. "
            f"Try {advice or self.advice or 'a lower learning rate'}; {back}"
        )
