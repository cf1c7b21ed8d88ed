"""Run an experiment whose rank 0, in a world of one, holds its WAIT_STEP-th optimizer step until torchrun's agent
stops the workers (SIGTERM): for the elastic test where a second node joins a running job.

    python -m ddp_core.torchrun --nnodes=1:2 ... -m tests.hosts.wait_for_more_nodes experiments.toy [flags]

The run must still be going when the second node arrives, however slowly that node starts: the agent restarts
its workers as soon as a node waits to join (torch's elastic agent: a membership change), so the step ends on
that signal, not after a guessed time. The run's own SIGTERM handler still runs first (it is chained): the
step finishes, the run writes its checkpoint and exits 143, as any stopped run does. At any other world size,
or if no signal comes within WAIT_LIMIT_S (a failure the test then reports), the step runs as usual.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading

import torch


def hold_until_stopped(at_step: int, limit_s: float) -> None:
    original_step = torch.optim.SGD.step
    calls = 0

    def step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_step and os.environ.get("WORLD_SIZE") == "1":
            stopped = threading.Event()
            previous = signal.getsignal(signal.SIGTERM)

            def on_sigterm(signum, frame):
                if callable(previous):
                    previous(signum, frame)  # the run's own: stop after this step, with a checkpoint
                stopped.set()

            signal.signal(signal.SIGTERM, on_sigterm)
            stopped.wait(limit_s)
        return original_step(self, *args, **kwargs)

    torch.optim.SGD.step = step


if __name__ == "__main__":
    hold_until_stopped(int(os.environ["WAIT_STEP"]), float(os.environ.get("WAIT_LIMIT_S", "120")))
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
