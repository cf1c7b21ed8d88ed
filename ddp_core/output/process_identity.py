"""Which process wrote a run, so that ``python -m ddp_core.runs`` can tell a running run from a killed one.

No torch here: the runs table never imports it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


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
    if (
        not isinstance(process, dict)
        or process.get("host") != socket.gethostname()
        or not isinstance(process.get("pid"), int)
    ):
        return None
    pid = process["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive: another user's
    except (OSError, OverflowError):
        return None
    fields = stat_fields(pid)
    if fields and fields[0] in ("Z", "X"):  # it exited; its parent has not collected it (a container's PID 1 may never)
        return False
    now = fields[19] if len(fields) > 19 else None
    return now is None or process.get("pid_start") in (None, now)
