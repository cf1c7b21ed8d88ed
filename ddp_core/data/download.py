"""A dataset downloaded once per filesystem, before the process group exists: every process takes an ``flock``
in turn, and the first downloads. A failure is left for the same job's processes behind the lock, which raise
the same line instead of trying again; an earlier job's failure is ignored."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Callable

from ddp_core.errors import ConfigError


def lock_file(name: str) -> str:
    return f".{name}-download.lock"


def failure_file(name: str) -> str:
    return f".{name}-download.failed"


def download_once(
    folder: Path, name: str, complete: Callable[[], bool], fetch: Callable[[], None], instead: str, job: str | None
) -> None:
    """``fetch()`` unless ``complete()``, one process at a time; ``instead`` ends a failure's line."""
    folder.mkdir(parents=True, exist_ok=True)
    job = job_id() if job is None else job
    failed = folder / failure_file(name)
    with open(folder / lock_file(name), "a") as lock:  # "a": created if missing, never truncated
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, and by the kernel if this process dies
        earlier = failure_of_this_job(failed, job)
        if earlier:
            raise ConfigError(earlier)
        if complete():
            return
        try:
            fetch()
        except Exception as error:  # the network, the disk, a bad archive: one line on every process
            reason = " ".join(str(error).split())[:200] or type(error).__name__
            message = (
                f"--download failed ({type(error).__name__}: {reason}): check this machine's network access, "
                f"or {instead}"
            )
            if job:
                failed.write_text(json.dumps({"job": job, "time": time.time(), "message": message}))
            raise ConfigError(message) from None
        failed.unlink(missing_ok=True)


def job_id() -> str:
    """What every process of one launch shares, and a relaunch or a restart does not ("" for a world of one)."""
    names = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    parts = [os.environ.get(name, "") for name in names]
    return "/".join(parts) if any(parts) else ""


def failure_of_this_job(failed: Path, job: str) -> str | None:
    """The message of a failed download by another process of this job, if there is one."""
    try:
        failure = json.loads(failed.read_text())
    except (OSError, ValueError):
        return None
    # The time too: a static rendezvous relaunched on the same port has the same job id.
    if not job or failure.get("job") != job or failure.get("time", 0) < process_started_at():
        return None
    return str(failure.get("message", "--download failed in another process of this job"))


def process_started_at() -> float:
    """When this process started, wall clock (Linux's /proc, to the second); elsewhere, now."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + int(after_name[19]) / os.sysconf("SC_CLK_TCK") - 1.0  # btime is whole seconds: a second's margin
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
