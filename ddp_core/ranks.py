"""Which process is global rank 0 (``RANK`` 0, unset or blank; never the local rank), torch-free.

Rank 0's work goes through ``on_rank0`` or, where every rank needs its outcome, ``rank0_decides``
(ddp_core/distributed/agreement.py); tests/unit/test_one_way.py limits who reads ``is_global_rank0``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

# ``log.warning(..., extra=THIS_RANK)``: a line about this rank alone, shown on every rank that logs it
THIS_RANK = {"this_rank": True}


def is_global_rank0() -> bool:
    """True on global rank 0: the process group's rank once one exists, else ``RANK`` from the launcher."""
    dist = sys.modules.get("torch.distributed")  # imported by whoever made a group; never imported here
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return launcher_rank() in (None, 0)


def on_rank0(action: Callable[[], T]) -> T | None:
    """Global rank 0 runs ``action`` and returns its result; every other rank returns None. Nothing is sent, so it
    works before any process group; where the others need the outcome, ``rank0_decides``."""
    return action() if is_global_rank0() else None


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """``RANK`` as the launcher set it, read as torch reads it ("00" is 0); None when unset, blank or no integer
    (``DistEnv`` refuses that)."""
    raw = (os.environ if environ is None else environ).get("RANK", "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def is_local_rank0() -> bool:
    """True on each node's first process (``LOCAL_RANK`` 0, unset or blank): what prints a node's own problems."""
    return os.environ.get("LOCAL_RANK", "").strip() in ("", "0")
