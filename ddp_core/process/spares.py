"""Warm spares: a restarted worker that is an interpreter started earlier, torch and ddp-lab already imported.

A restart under ``--max-restarts`` starts every worker again, and each new interpreter imports torch, then
``torch._dynamo`` (DDP's constructor reads one of its settings): seconds of CPU per process, paid by the whole job
while it waits (bench.recovery measures it). With ``DDP_LAB_WARM_SPARES=1``, ``python -m ddp_core.torchrun``
starts, once a worker group is up and restarts remain, one spare per local worker: ``python -u -m
ddp_core.process.spares``, which imports what a worker needs (``PRELOAD``) and waits on its stdin. When torchrun
starts the next group, each worker it would start as ``python -u -m MODULE ARGS`` is a spare instead: the spare
reads its environment and arguments, and becomes ``python -m MODULE ARGS`` (``runpy``, as ``-m`` does).

The spare is the agent's own child, started as torchrun starts its workers (its own session, killed when the
agent dies): torchrun watches, signals and reaps it as any worker. What it does not reproduce: the interpreter's
start-up with the worker's environment (a variable read while torch or ddp-lab is imported keeps the value it
had when the spare started; ``OMP_NUM_THREADS`` is applied again), and output redirected by torchrun
(``--redirects``, ``--tee``, ``--log-dir``): a worker whose output goes to a file is started as before. The spares
import while the workers train, on the same cores.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from ddp_core.process.orphans import die_with_parent

VARIABLE = "DDP_LAB_WARM_SPARES"
# What a worker imports before its first step: torch, DDP's lazy torch._dynamo, ddp-lab's run (the experiment's
# own module is imported when it runs: its code is the user's)
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "ddp_core.experiment")


def enabled() -> bool:
    return os.environ.get(VARIABLE, "") not in ("", "0")


class Spares:
    """The launcher's side: spares by the (python, module) they were started for, handed out once each."""

    def __init__(self) -> None:
        self.ready: dict[tuple[str, str], list[subprocess.Popen]] = {}

    def start(self, python: str, module: str, count: int, popen: Callable[..., subprocess.Popen]) -> None:
        """``count`` more spares for ``python -u -m module`` (beyond those not yet handed out)."""
        waiting = self.ready.setdefault((python, module), [])
        for _ in range(count - len(waiting)):
            waiting.append(
                popen(
                    [python, "-u", "-m", __name__],
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=partial(die_with_parent, os.getpid()),
                )
            )

    def take(self, args: Any, env: dict[str, str] | None, **kwargs: Any) -> subprocess.Popen | None:
        """A spare become the worker ``args`` (``python -u -m MODULE ...``), or None where none fits."""
        args = [str(arg) for arg in args] if isinstance(args, (list, tuple)) else []
        redirected = kwargs.get("stdout") is not None or kwargs.get("stderr") is not None
        if len(args) < 4 or args[1:3] != ["-u", "-m"] or redirected or env is None:
            return None
        waiting = self.ready.get((args[0], args[3]), [])
        while waiting:
            spare = waiting.pop(0)
            if spare.poll() is not None or spare.stdin is None:
                continue  # it died while waiting
            try:
                spare.stdin.write(json.dumps({"argv": args[3:], "env": env}).encode() + b"\n")
                spare.stdin.close()
            except OSError:
                continue
            return spare
        return None

    def stop(self) -> None:
        """The spares no group took: at the job's end."""
        for waiting in self.ready.values():
            for spare in waiting:
                if spare.poll() is None:
                    spare.kill()
                    spare.wait()
        self.ready.clear()


def become_worker() -> None:
    """The spare's side: import ``PRELOAD``, wait for the worker's arguments and environment, then run it."""
    for name in PRELOAD:
        importlib.import_module(name)
    line = sys.stdin.buffer.readline()
    if not line:
        return  # the launcher ended without using it
    order = json.loads(line)
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # a worker started by torchrun reads nothing either
    os.environ.clear()
    os.environ.update(order["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    module, *arguments = order["argv"]
    sys.argv = [module, *arguments]  # run_module puts the module's file first, as ``python -m`` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    become_worker()
