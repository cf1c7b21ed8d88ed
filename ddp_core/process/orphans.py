"""Workers never outlive their launcher: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, a parent already gone found by its
pid. Linux only (docs/decisions.md, "The launcher").
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_VARIABLE = "DDP_LAB_LAUNCHER_PID"  # set by ddp_core.torchrun's agent for the workers it starts
SUPPORTED = sys.platform.startswith("linux")
# Built here, in the launcher: between fork and exec only an already-built function is called. prctl is
# variadic; its arguments after the first are unsigned longs.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if SUPPORTED else None
_REQUEST = (ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), *(ctypes.c_ulong(0),) * 3)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (its parent's pid when it started) dies."""
    if _prctl is None:
        return
    if _prctl(*_REQUEST) != 0:
        return  # refused: nothing else to do before exec; the worker runs as it did before
    if os.getppid() != parent:  # the parent died before the request: nothing will send the signal now
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """Under ``python -m ddp_core.torchrun``: ``die_with_parent`` for the launcher named in (and taken out of) the
    environment; a worker whose parent is another (a fork server's child) only dies if the launcher is gone."""
    value = os.environ.pop(LAUNCHER_PID_VARIABLE, "")
    if not value.isdigit():
        return
    launcher = int(value)
    if os.getppid() == launcher:
        die_with_parent(launcher)
        return
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except PermissionError:
        pass  # alive, and another user's: not ours to judge
