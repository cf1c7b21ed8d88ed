"""A log point's figures read one log interval later, so that the log point does not make the host wait for the GPU
(docs/decisions.md, "Log points read late"): the row is all-gathered on the device and copied into pinned host
memory behind the step's kernels; the loop reads it at the next log point or pause and acts on it then (the loss
line, a divergence, a stop signal). Every rank sends and receives at the same steps, so all read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_core.distributed.collectives import all_gather_tensors, comm_device
from ddp_core.training.transfer import upload

LOG_READS = ("auto", "late", "now")  # --log-reads


def reads_late(choice: str, device: torch.device) -> bool:
    """``--log-reads``: auto is late where the device runs ahead of the host (CUDA)."""
    return choice == "late" or (choice == "auto" and device.type == "cuda")


@dataclass(frozen=True)
class Sent:
    """A log point: its ``step``, ``epoch`` and ``lr``, and the step its step times end at (the log point before)."""

    step: int
    epoch: int
    lr: float
    times_step: int


@dataclass
class _InFlight:
    sent: Sent
    rows: torch.Tensor  # (ranks, columns) in host memory, filled once ``done`` has completed
    done: torch.cuda.Event | None  # None: already filled (no GPU)
    host: list[float] | None  # a world of one: the columns that never left the host


class LateReads:
    """One log point's figures in flight at a time: ``send`` queues them, ``receive`` reads them later."""

    def __init__(self) -> None:
        self._in_flight: _InFlight | None = None

    def send(self, sent: Sent, on_device: torch.Tensor, on_host: list[float]) -> None:
        """Queue ``on_device`` (float64, this rank's first columns) and ``on_host`` (the rest) for reading later;
        a collective where several ranks run. The host does not wait for the GPU."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        host: list[float] | None = None
        if world == 1:
            rows, host = on_device.reshape(1, -1), list(on_host)
        else:
            where = comm_device()
            row = torch.cat([on_device.to(where), upload(torch.tensor(on_host, dtype=torch.float64), where)])
            rows = torch.stack([per_rank[0] for per_rank in all_gather_tensors([row])])
        done = None
        if rows.device.type == "cuda":
            copy = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            copy.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            copy = rows.clone()
        self._in_flight = _InFlight(sent, copy, done, host)

    def receive(self) -> tuple[Sent, list[list[float]]] | None:
        """The figures sent last, every rank's row in rank order (None: none in flight). Waits for the GPU only as
        long as it still computes them (a log point every step)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        if flight.done is not None:
            flight.done.synchronize()
        rows = flight.rows.tolist()
        if flight.host is not None:
            rows = [row + flight.host for row in rows]
        return flight.sent, rows
