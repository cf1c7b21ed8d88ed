"""The toy experiment with one fault injected on one rank, for the crash and hang tests.

    torchrun ... -m tests.e2e.faulty_toy [toy flags]     with FAULT=crash|hang|kill_in_save, FAULT_RANK, FAULT_STEP

`crash` and `hang` fire inside the FAULT_STEP-th optimizer step of rank FAULT_RANK: `crash` raises an
exception (the others are then inside a collective), `hang` blocks forever in Python (the others wait in
the next collective). `kill_in_save` SIGKILLs that rank halfway through writing its FAULT_STEP-th
checkpoint file. Test code only: the experiment itself has no fault hooks.
"""

from __future__ import annotations

import io
import os
import signal
import threading

import torch

from experiments import toy


class InjectedFault(RuntimeError):
    pass


def inject() -> None:
    fault, rank, at_step = os.environ["FAULT"], int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_STEP"])
    if int(os.environ.get("RANK", "0")) != rank:
        return
    if fault == "kill_in_save":
        kill_halfway_through_a_save(at_step)
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


def kill_halfway_through_a_save(at_save: int) -> None:
    original_save = torch.save
    saves = 0

    def save(obj, f, *args, **kwargs):
        nonlocal saves
        if not isinstance(f, io.BufferedWriter):  # torch pickles tensors for collectives with torch.save too
            return original_save(obj, f, *args, **kwargs)
        saves += 1
        if saves < at_save:
            return original_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        original_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write, as a preemption without grace or an OOM kill would

    torch.save = save


if __name__ == "__main__":
    inject()
    toy.main()
