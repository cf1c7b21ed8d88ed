"""The run directory's names, in one place and torch-free (``python -m ddp_core.runs`` reads runs without torch).
It imports nothing of ddp_core, so every layer may read it (docs/design.md, "Layers").

runs/<experiment>/<UTC stamp>[-N]/      STAMP, the default name (--run-dir sets any other)
    manifest.json                       MANIFEST: the config, versions, commit, each launch and its exit
    metrics.json                        METRICS: the final metrics, once the run has ended
    events.out.tfevents.*               EVENTS: TensorBoard's files (its own names)
    code/                               CODE: the code that ran (rank 0, as the directory is made)
        toy.py                          the experiment's file, copied
        git.diff                        GIT_DIFF: git diff HEAD of the working tree, cut at 1 MiB
    failure_node0.txt                   failure_report_name(node): torch's full output when a rank failed
    flight_recorder_rank_0              FLIGHT_RECORDER + rank: the collectives a timed-out rank saw last
    stacks_rank_0.txt                   stacks_name(rank): a hung job's stacks of that rank, its line first
    checkpoints/                        CHECKPOINTS
        step_00001234.pt                STEP_FILE (STEP_GLOB), step_file_name(step): the newest KEEP kept
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
STEP_GLOB = "step_*.pt"
MANIFEST = "manifest.json"
METRICS = "metrics.json"
EVENTS = "events.out.tfevents.*"
FLIGHT_RECORDER = "flight_recorder_rank_"
PROFILE = "profile"
CODE = "code"
GIT_DIFF = "git.diff"


def step_file_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def failure_report_name(node_rank: int) -> str:
    return f"failure_node{node_rank}.txt"


def profile_trace_name(rank: int) -> str:
    return f"rank{rank}.json"


def memory_snapshot_name(rank: int) -> str:
    return f"memory_rank{rank}.pickle"


def stacks_name(rank: int | str) -> str:
    return f"stacks_rank_{rank}.txt"
