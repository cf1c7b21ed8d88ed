"""Which process is global rank 0, the one that writes the run directory and prints a run's one-line reasons.

One rule everywhere, before and after the process group exists: global rank 0 is the process whose ``RANK``
is 0, or unset or blank (a world of one, or ``--nproc``'s parent before it starts its workers). Never the
*local* rank: every node has a local rank 0. Torch-free: it runs while arguments are parsed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# ``log.warning(..., extra=THIS_RANK)``: a line about this rank alone (its GPU, its files), shown on every rank that
# logs it; any other warning is one every rank gives alike, shown once, by global rank 0 (ddp_core/output/logging.py).
THIS_RANK = {"this_rank": True}


def is_global_rank0() -> bool:
    """True on global rank 0: the process group's rank once one exists, else ``RANK`` from the launcher."""
    dist = sys.modules.get("torch.distributed")  # imported by whoever made a group; never imported here
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return launcher_rank() in (None, 0)


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
