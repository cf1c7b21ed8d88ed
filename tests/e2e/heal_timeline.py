"""What a --heal job's timeline (``DDP_LAB_TIMELINE``, its workers' phases noted by ``bench.timeline``) tells a test:
which process is a rank's worker, and whether a killed one was replaced alone (tests/hosts, tests/gpu)."""

from __future__ import annotations

import signal
from pathlib import Path

from ddp_core.process import timeline


def training_pid(path: Path, rank: int) -> int | None:
    """The pid of ``rank``'s worker once it has taken a step (its client, ddp_core.process.warm, notes none)."""
    return next((e["pid"] for e in timeline.read(path) if e["event"] == "first_step" and e["rank"] == rank), None)


def worker_pids(path: Path) -> dict[int, set[int]]:
    """Each rank's worker processes: every pid that noted a phase as that rank, its client's ``replaced`` aside."""
    pids: dict[int, set[int]] = {}
    for event in timeline.read(path):
        if event["rank"] is not None and event["event"] != "replaced":
            pids.setdefault(event["rank"], set()).add(event["pid"])
    return pids


def check_replaced_alone(path: Path, victim: int, before: dict[int, int]) -> None:
    """``victim``'s worker (pid ``before[victim]``), SIGKILLed, was replaced once and its replacement healed from a
    peer; every other rank kept its process (``before``: each rank's pid at the kill)."""
    events = timeline.read(path)
    replaced = [(e["rank"], e["replacement"], e["code"]) for e in events if e["event"] == "replaced"]
    assert replaced == [(victim, 1, -signal.SIGKILL)], replaced
    pids = worker_pids(path)
    survivors = [rank for rank in before if rank != victim]
    assert {rank: pids[rank] for rank in survivors} == {rank: {before[rank]} for rank in survivors}
    (replacement,) = pids[victim] - {before[victim]}
    assert [e["rank"] for e in events if e["event"] == "healed" and e["pid"] == replacement] == [victim]
