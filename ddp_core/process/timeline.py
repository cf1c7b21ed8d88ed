"""Timestamps of a restart's phases, for ``bench.recovery``: one JSON line per event, only where it asks for them.

``DDP_LAB_TIMELINE=FILE`` (set by the benchmark, inherited by the launcher and its workers) makes the launcher
note when it saw a worker fail, when the others were stopped and when the new ones were started, and each worker
when its imports were done, its process group formed, its checkpoint loaded and its first step taken. Each line
holds the wall-clock time, the process, its global rank (the launcher: none) and the restart it belongs to
(``TORCHELASTIC_RESTART_COUNT``). Lines are appended with one ``write`` each (``O_APPEND``), so the processes of
one job share the file. Without the variable nothing is written; a failed write loses the line, never the run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

VARIABLE = "DDP_LAB_TIMELINE"


def mark(event: str, **fields: Any) -> None:
    """Note ``event`` now, with ``fields`` (a step, say), where ``DDP_LAB_TIMELINE`` names a file."""
    path = os.environ.get(VARIABLE)
    if not path:
        return
    rank = os.environ.get("RANK")
    line = {
        "t": time.time(),
        "event": event,
        "pid": os.getpid(),
        "rank": int(rank) if rank is not None and rank.isdigit() else None,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        **fields,
    }
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read(path: str | Path) -> list[dict[str, Any]]:
    """Every event in ``path``, oldest first (a line cut short by a kill is skipped)."""
    events = []
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return sorted(events, key=lambda event: event["t"])
