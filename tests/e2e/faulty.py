"""An experiment with one fault injected on one rank, for the crash, hang and kill tests.

    torchrun ... -m tests.e2e.faulty experiments.toy [flags]     with FAULT, FAULT_RANK, FAULT_STEP

`nan_loss` makes the training loss of rank FAULT_RANK NaN in its FAULT_STEP-th loss computation (the
training loss modules of the toy and CIFAR10; evaluation uses the functional form and is not hit).
`crash`, `hang`, `sigkill` and `sigterm` fire inside the FAULT_STEP-th optimizer step of rank FAULT_RANK:
`crash` raises an exception (the others are then inside a collective), `hang` blocks forever in Python
(the others wait in the next collective), `sigkill` kills the process, in the first attempt only (a
restarted worker runs clean; FAULT_STEP may list one step per attempt, `25,9,6`: attempt K, counted by
TORCHELASTIC_RESTART_COUNT, is killed in its K-th listed step, counted from its own start), `sigterm`
sends the process a stop request, `kill_node` kills the whole node as a power cut would (torchrun's agent
first, so nothing there restarts, then every worker, SIGKILL) once: FAULT_ONCE names a file it creates first,
so the node started again runs clean.
`kill_in_save` SIGKILLs that rank halfway through writing its FAULT_STEP-th
checkpoint file. `disk_full` and `unwritable` act on every file under FAULT_DIR from that rank's
FAULT_STEP-th checkpoint file on: `disk_full` lets files be created but every write to them fail with
ENOSPC (a full disk), `unwritable` makes opening one for writing fail with EACCES (a run directory made
read-only: as root, chmod would not stop this process). `late` starts rank FAULT_RANK FAULT_DELAY_S
seconds late, as a slow node would (FAULT_STEP is not used). `slow` makes rank FAULT_RANK sleep FAULT_DELAY_S
seconds in each optimizer step from its FAULT_STEP-th on, as a slower GPU or a busy host would. Test code only:
the experiments themselves have no fault hooks.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

import torch


class InjectedFault(RuntimeError):
    pass


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def inject(lazy: bool = False) -> None:
    """``lazy``: the process does not know its rank yet (a --nproc worker, tests/e2e/fault_site): the step faults
    check it when they fire."""
    fault, rank = os.environ["FAULT"], int(os.environ["FAULT_RANK"])
    per_attempt = [int(step) for step in os.environ["FAULT_STEP"].split(",")]
    at_step = per_attempt[0]
    if not lazy and this_rank() != rank:
        return
    if fault == "late":
        time.sleep(float(os.environ["FAULT_DELAY_S"]))  # the fault itself: a node that comes up late
        return
    if fault == "kill_in_save":
        kill_halfway_through_a_save(at_step)
        return
    if fault in ("disk_full", "unwritable"):
        fail_writes_under(os.environ["FAULT_DIR"], errno.ENOSPC if fault == "disk_full" else errno.EACCES, at_step)
        return
    if fault == "nan_loss":
        poison_the_loss(at_step)
        return
    original_step = torch.optim.SGD.step
    calls = 0

    def step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if fault == "slow" and calls >= at_step and this_rank() == rank:
            time.sleep(float(os.environ["FAULT_DELAY_S"]))  # the fault itself: this rank computes slower
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if fault == "sigkill" and 0 < attempt < len(per_attempt) and calls == per_attempt[attempt]:
            if this_rank() == rank:
                os.kill(os.getpid(), signal.SIGKILL)  # a later attempt's fault
        if calls == at_step and this_rank() == rank:
            if fault == "crash":
                raise InjectedFault(f"injected fault on rank {rank} at step {at_step}")
            if fault == "sigkill" and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice to this rank only, mid-step
            if fault == "kill_node" and first_time(os.environ["FAULT_ONCE"]):
                kill_this_node()
            if fault == "hang":
                threading.Event().wait()  # never returns, and no signal handler makes it return
        return original_step(self, *args, **kwargs)

    torch.optim.SGD.step = step


def first_time(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def kill_this_node() -> None:
    """The agent (this worker's parent), then every worker it started (each in a session of its own), then this one."""
    agent = os.getppid()
    if b"tests.prefork" in Path(f"/proc/{agent}/cmdline").read_bytes():
        raise RuntimeError("kill_node needs real processes: launch it with sys.executable, not tests.prefork's python")
    workers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent and int(stat.parent.name) != os.getpid():
                workers.append(int(stat.parent.name))
    os.kill(agent, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def poison_the_loss(at_call: int) -> None:
    calls = 0
    for loss_class in (torch.nn.MSELoss, torch.nn.CrossEntropyLoss):
        original_forward = loss_class.forward

        def forward(self, *args, _original=original_forward, **kwargs):
            nonlocal calls
            calls += 1
            loss = _original(self, *args, **kwargs)
            return loss * float("nan") if calls == at_call else loss

        loss_class.forward = forward


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


class _FullDisk(io.FileIO):
    """A file on a full disk: it can be created, but no byte can be written to it."""

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_writes_under(directory: str, error_number: int, at_save: int) -> None:
    """From the ``at_save``-th checkpoint file on, writing any file under ``directory`` fails (builtins.open
    and io.open: what torch.save's handle, json files and TensorBoard's event writer go through)."""
    directory = os.path.abspath(directory) + os.sep
    original_open = builtins.open
    saves, failing = 0, False

    def guarded_open(file, mode="r", *args, **kwargs):
        nonlocal saves, failing
        path = os.path.abspath(os.fsdecode(file)) if isinstance(file, (str, bytes, os.PathLike)) else ""
        if path.startswith(directory) and any(flag in mode for flag in "wax+"):
            if os.path.basename(path).startswith(".step_"):  # the temp file of a checkpoint
                saves += 1
                failing = failing or saves >= at_save
            if failing and error_number == errno.EACCES:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            if failing:
                return io.BufferedWriter(_FullDisk(path, mode.replace("b", "").replace("+", "") or "w"))
        return original_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open


if __name__ == "__main__":
    inject()
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
