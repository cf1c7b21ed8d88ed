"""The workers' side of ``bench.recovery``'s timeline: each worker's phases, noted by an observer.

The launcher notes its own events (``ddp_core/process/timeline.py``, where the file's format is); a worker notes
when its imports were done, its process group formed, its checkpoint loaded and its first step taken through this
module's observer (``ddp_core/observers.py``), installed by ``env``.
"""

from __future__ import annotations

import os
from typing import Any

from ddp_core import observers
from ddp_core.process import timeline


class Timeline(observers.Observer):
    def mark(self, event: str, **fields: Any) -> None:
        timeline.mark(event, **fields)


def observer() -> Timeline | None:
    """The worker's timeline, where the benchmark named a file."""
    return Timeline() if os.environ.get(timeline.VARIABLE) else None


def env(path: str) -> dict[str, str]:
    """What a job started by the benchmark (its launcher and its workers) needs to note its phases in ``path``."""
    return {timeline.VARIABLE: path, **observers.env(__name__)}
