"""Which process wrote a run, so that ``python -m ddp_core.runs`` can tell a running run from a killed one.

No torch here: the runs table never imports it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

PROC_STAT = Path("/proc/self/stat").exists()  # Linux's /proc: a process's state and start time can be read


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name (Linux): [0] the state, [19] the start time."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux); a later process reusing the pid has another."""
    fields = stat_fields(pid)
    return fields[19] if len(fields) > 19 else None


def this_process() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": start_time(os.getpid())}


def alive_here(process: Any) -> bool | None:
    """Whether ``process`` (what ``this_process`` returned then) still runs; None where this host cannot tell."""
    pid = process.get("pid") if isinstance(process, dict) else None
    if not isinstance(pid, int) or process.get("host") != socket.gethostname():
        return None
    theirs = False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        theirs = True  # alive: another user's, whose /proc entry may be hidden (hidepid)
    except (OSError, OverflowError):
        return None
    fields = stat_fields(pid)
    if not fields and PROC_STAT and not theirs:
        # It ended between the two looks: on a busy machine, often a later process that held the pid for a moment
        # (bench.pid_reuse: read as alive in 1,187 of 2,000 trials before this line).
        return False
    if fields and fields[0] in ("Z", "X"):  # it exited; its parent has not collected it (a container's PID 1 may never)
        return False
    now = fields[19] if len(fields) > 19 else None
    return now is None or process.get("pid_start") in (None, now)
