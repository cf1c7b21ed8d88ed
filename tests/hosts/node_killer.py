"""An experiment whose whole node dies at one optimizer step: torchrun's agent and every worker, SIGKILL.

    torchrun ... -m tests.hosts.node_killer experiments.toy [flags]     with KILL_RANK, KILL_STEP, KILL_ONCE

Rank KILL_RANK kills its node in its KILL_STEP-th optimizer step (SGD's), as a power cut or a kernel
panic would: the agent first (so nothing on that node restarts), then the other workers, then itself.
KILL_ONCE is a file it creates first, so the node started again, and every later attempt, runs clean.
Test code only: the experiments have no fault hooks.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
from pathlib import Path

import torch


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def kill_this_node() -> None:
    agent = os.getppid()
    workers = [pid for pid in _children(agent) if pid != os.getpid()]
    os.kill(agent, signal.SIGKILL)
    for pid in workers:  # torchrun starts each worker in a session of its own
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def arm() -> None:
    if os.environ.get("RANK") != os.environ["KILL_RANK"]:
        return
    at_step, once = int(os.environ["KILL_STEP"]), os.environ["KILL_ONCE"]
    original_step = torch.optim.SGD.step
    calls = 0

    def step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_step:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                kill_this_node()
        return original_step(self, *args, **kwargs)

    torch.optim.SGD.step = step


if __name__ == "__main__":
    arm()
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
