"""A log point's figures: what each rank hands over, filled by name by the part that owns each (the metrics log:
the loss sum and count, the rank's times; the stop policy: the guard's verdict, only where the point is read late,
and the stop-signal flag), and the one place that lays them out as a row for the collective. A row travels as
float64, the device's columns first (no host read before the collective); read back, it is a ``LogRow``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ddp_core.distributed.collectives import all_gather_tensors, comm_device
from ddp_core.training.guard import VERDICT_COLUMNS, Verdict

HOST_BEFORE_TIMES = 2  # the host's columns before the times: the loss count, the signal flag


@dataclass
class LogPoint:
    """This rank's figures at one log point, each set by its owner."""

    loss_sum: torch.Tensor | None = None  # float64, on the device
    loss_count: int = 0
    times: list[float] = field(default_factory=list)
    verdict: torch.Tensor | None = None  # the guard's ``local_row``, on the device
    signal: bool = False

    def pack(self) -> tuple[torch.Tensor, list[float]]:
        """The row: its device columns (the verdict where there is one, the loss sum) and its host columns."""
        assert self.loss_sum is not None, "the metrics log fills every log point"
        loss_sum = self.loss_sum.reshape(1)
        on_device = loss_sum if self.verdict is None else torch.cat([self.verdict, loss_sum])
        return on_device, [float(self.loss_count), float(self.signal), *self.times]


@dataclass(frozen=True)
class LogRow:
    """One rank's figures, read back on the host."""

    loss_sum: float
    loss_count: int
    times: list[float]
    verdict: Verdict | None
    signal: bool

    @classmethod
    def unpack(cls, row: Sequence[float], with_verdict: bool) -> LogRow:
        """A row ``LogPoint.pack`` laid out (device columns, then host columns), by name."""
        at = VERDICT_COLUMNS if with_verdict else 0
        verdict = Verdict(*row[:at]) if with_verdict else None
        loss_sum, count, signal = row[at], row[at + 1], row[at + 2]
        return cls(loss_sum, round(count), list(row[at + 1 + HOST_BEFORE_TIMES :]), verdict, bool(signal))


def gather_now(point: LogPoint) -> list[LogRow]:
    """Every rank's figures, in rank order: one collective, read on the host (a synchronization)."""
    on_device, on_host = point.pack()
    host = torch.tensor(on_host, dtype=torch.float64, device=on_device.device)
    local = torch.cat([on_device, host]).to(comm_device())
    rows = [tensors[0].tolist() for tensors in all_gather_tensors([local])]
    return [LogRow.unpack(row, with_verdict=point.verdict is not None) for row in rows]
