"""Each worker's run directory and the step it has reached, for the launcher's report when a rank dies silently.

``DDP_LAB_JOB_DIR/rank_<R>``: the step (fixed width, one ``pwrite`` per step), host and run directory; nothing
without the variable (plain torchrun, a world of one).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ddp_core.layout import stacks_name
from ddp_core.ranks import on_rank0

JOB_DIR_ENV = "DDP_LAB_JOB_DIR"
_WIDTH = 12  # the step field: digits, then a newline

_fd: int | None = None


def started(run_dir: Path) -> None:
    """This rank's run directory is known: open its heartbeat (step 0 until the first beat)."""
    global _fd
    job_dir, rank = os.environ.get(JOB_DIR_ENV), os.environ.get("RANK")
    if not job_dir or rank is None:
        return
    try:
        fd = os.open(Path(job_dir) / f"rank_{int(rank)}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, f"{0:{_WIDTH - 1}d}\n{socket.gethostname()}\n{Path(run_dir).resolve()}\n".encode())
        # an earlier launch's hang is not this one's; rank 0 alone writes the run directory
        on_rank0(lambda: [stale.unlink(missing_ok=True) for stale in Path(run_dir).glob(stacks_name("*"))])
    except (OSError, ValueError):
        return  # the report loses the step, never the run
    if _fd is not None:
        os.close(_fd)
    _fd = fd


def beat(step: int) -> None:
    """This rank has done ``step`` optimizer steps (counting those before a resume)."""
    if _fd is not None:
        try:
            os.pwrite(_fd, f"{step:{_WIDTH - 1}d}\n".encode(), 0)
        except OSError:
            pass


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    step: int
    host: str
    run_dir: Path


def read(job_dir: str | Path) -> dict[int, Heartbeat]:
    """Every heartbeat in ``job_dir``, by global rank (those of this node)."""
    beats: dict[int, Heartbeat] = {}
    for path in Path(job_dir).glob("rank_*"):
        try:
            step, host, run_dir = path.read_text().splitlines()[:3]
            rank = int(path.name.removeprefix("rank_"))
            beats[rank] = Heartbeat(rank, int(step), host, Path(run_dir))
        except (OSError, ValueError):
            continue
    return beats


def run_dir(job_dir: str | Path) -> Path | None:
    """The run directory of this node's lowest rank, None before any knew it."""
    beats = read(job_dir)
    return beats[min(beats)].run_dir if beats else None
