"""Which process is global rank 0, the one that writes the run directory and prints a run's one-line reasons.

One rule everywhere, before and after the process group exists: global rank 0 is the process whose ``RANK``
is 0, or unset or blank (a world of one, or ``--nproc``'s parent before it starts its workers). Never the
*local* rank: every node has a local rank 0. Torch-free: it runs while arguments are parsed.

Rank 0's work goes through ``on_rank0`` (here: nothing is sent) or ``rank0_decides`` (ddp_core/distributed/agreement.py:
``on_rank0`` and a broadcast of its outcome, for work every rank must learn the outcome of). Output keys on the same
test in ddp_core/output/logging.py. ``is_global_rank0`` itself is read only by the few modules
tests/unit/test_one_way.py allows.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

# ``log.warning(..., extra=THIS_RANK)``: a line about this rank alone (its GPU, its files), shown on every rank that
# logs it; any other warning is one every rank gives alike, shown once, by global rank 0 (ddp_core/output/logging.py).
THIS_RANK = {"this_rank": True}


def is_global_rank0() -> bool:
    """True on global rank 0: the process group's rank once one exists, else ``RANK`` from the launcher."""
    dist = sys.modules.get("torch.distributed")  # imported by whoever made a group; never imported here
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return launcher_rank() in (None, 0)


def on_rank0(action: Callable[[], T]) -> T | None:
    """Global rank 0 runs ``action`` and returns its result; every other rank returns None without running it.

    Nothing is sent, so it may be called where the other ranks are elsewhere, or before any process group: work whose
    outcome the other ranks do not need (a line, a file rank 0 alone reads). When they do, ``rank0_decides``."""
    return action() if is_global_rank0() else None


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """``RANK`` as the launcher set it, read as torch reads it ("00" is 0): None when unset or blank, and when it
    is no integer (``DistEnv`` refuses that with one line before any process group forms)."""
    raw = (os.environ if environ is None else environ).get("RANK", "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def is_local_rank0() -> bool:
    """True on each node's first process (``LOCAL_RANK`` 0, unset or blank): what prints a node's own problems."""
    return os.environ.get("LOCAL_RANK", "").strip() in ("", "0")
