"""The run directory's names, in one place and torch-free (``python -m ddp_core.runs`` reads runs without torch).

runs/<experiment>/<UTC stamp>[-N]/      STAMP, the default name (--run-dir sets any other)
    manifest.json  metrics.json  events.out.tfevents.*
    checkpoints/                        CHECKPOINTS
        step_00001234.pt                STEP_FILE, step_file_name(step): the newest KEEP kept by default
        last.pt                         LAST: always the newest complete one
"""

from __future__ import annotations

import re

STAMP = "%Y%m%dT%H%M%SZ"
CHECKPOINTS = "checkpoints"
LAST = "last.pt"
KEEP = 2
STEP_FILE = re.compile(r"step_(\d{8,})\.pt")


def step_file_name(step: int) -> str:
    return f"step_{step:08d}.pt"
