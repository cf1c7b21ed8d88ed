"""The toy experiment with one fault injected on one rank, for the crash and hang tests.

    torchrun ... -m tests.e2e.faulty_toy [toy flags]     with FAULT=crash|hang, FAULT_RANK, FAULT_STEP

The fault fires inside the optimizer step of the given global rank: `crash` raises an exception (the
others are then inside a collective), `hang` blocks forever in Python (the others wait in the next
collective). Test code only: the experiment itself has no fault hooks.
"""

from __future__ import annotations

import os
import threading

import torch

from experiments import toy


class InjectedFault(RuntimeError):
    pass


def inject() -> None:
    fault, rank, at_step = os.environ["FAULT"], int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_STEP"])
    if int(os.environ.get("RANK", "0")) != rank:
        return
    original_step = torch.optim.SGD.step
    calls = 0

    def step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_step:
            if fault == "crash":
                raise InjectedFault(f"injected fault on rank {rank} at step {at_step}")
            threading.Event().wait()  # hang: never returns, and no signal handler makes it return
        return original_step(self, *args, **kwargs)

    torch.optim.SGD.step = step


if __name__ == "__main__":
    inject()
    toy.main()
