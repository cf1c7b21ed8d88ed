"""The run directory's names, in one place and torch-free (``python -m ddp_core.runs`` reads runs without torch).

runs/<experiment>/<UTC stamp>[-N]/      STAMP, the default name (--run-dir sets any other)
    manifest.json  metrics.json  events.out.tfevents.*
    checkpoints/                        CHECKPOINTS
        step_00001234.pt                STEP_FILE, step_file_name(step): the newest KEEP kept by default
        last.pt                         LAST: always the newest complete one
    profile/                            PROFILE: --profile's files, each written by its own rank
        rank0.json                      profile_trace_name(rank): the torch.profiler trace (Chrome's format)
        memory_rank0.pickle             memory_snapshot_name(rank): on CUDA, the allocator's snapshot
"""

from __future__ import annotations

import re

STAMP = "%Y%m%dT%H%M%SZ"
CHECKPOINTS = "checkpoints"
LAST = "last.pt"
KEEP = 2
STEP_FILE = re.compile(r"step_(\d{8,})\.pt")
PROFILE = "profile"


def step_file_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def profile_trace_name(rank: int) -> str:
    return f"rank{rank}.json"


def memory_snapshot_name(rank: int) -> str:
    return f"memory_rank{rank}.pickle"
