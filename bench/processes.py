"""A benchmark's child command: its environment, and a session of its own, so that a timeout or Ctrl-C stops the
whole tree (torchrun and its workers), not only the direct child."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from ddp_core.config import options
from ddp_core.distributed.env import TORCHRUN_VARIABLES
from ddp_core.experiment import TrainingArgs


def option_variables(cls: type) -> tuple[str, ...]:
    """The environment variables the options of ``cls`` read (``option(env=...)``), in declaration order."""
    return tuple(f.metadata["env"] for f in options(cls) if f.metadata.get("env"))


# A launcher's around the benchmark, or a .env's settings for another job, must not reach its runs: each run's
# flags say all it needs.
LAUNCH_VARIABLES = (*TORCHRUN_VARIABLES, *option_variables(TrainingArgs), "DATA_DIR")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``LAUNCH_VARIABLES``, unbuffered, with ``extra``."""
    env = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_in_own_session(
    command: list[str], cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float, stop_grace_s: float = 30
) -> tuple[int | None, bool]:
    """The exit code (None if none came) and whether it ran past ``timeout_s``; stdout and stderr go to
    ``log_path``. Past the timeout or on Ctrl-C: SIGTERM to its process group (torchrun passes it to its
    workers), SIGKILL after ``stop_grace_s``."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            stop_group(process, stop_grace_s)
            return process.returncode, True
        except KeyboardInterrupt:
            stop_group(process, stop_grace_s)
            raise


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
