"""Checkpoint files written behind the training loop: the loop waits for a copy in host memory, not for the disk.

``to_host`` copies a state (every tensor cloned to CPU, every dict, list and tuple rebuilt), so the training steps
that follow cannot change what is being written. ``BackgroundWrites.start`` then hands the write to a writer
thread, one at a time: a second write first waits for the one in flight, and so does ``wait``, which the run calls
where it must know its checkpoint is on disk (its end, a stop). The write is what it was (temp file, fsync,
rename), so a kill at any moment still leaves the previous checkpoint whole. A process that leaves, through an
exception or through ``ddp_core.process.exit.leave``, finishes the write in flight first.

A write's error (a full disk) is kept and raised by the next ``start`` or ``wait``, on rank 0, inside the
collective that every rank calls there (``rank0_decides``): every rank then stops at that same step.
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


def rebuilt(state: Any, leaf: Callable[[Any], Any]) -> Any:
    """``state`` with every dict, list and tuple that holds something rebuilt (a dict keeps its type and what the
    instance carries, a state dict's ``_metadata``; a named tuple its type), and ``leaf`` applied to the rest."""
    if isinstance(state, dict):
        copied = copy.copy(state)
        for key, value in state.items():
            copied[key] = rebuilt(value, leaf)
        return copied
    if isinstance(state, (list, tuple)):
        values = [rebuilt(value, leaf) for value in state]
        if isinstance(state, list):
            return values
        return type(state)(*values) if hasattr(state, "_fields") else tuple(values)
    return leaf(state)


def to_host(state: Any) -> Any:
    """``state`` with every tensor copied to CPU memory of its own (also those already on the CPU), its containers
    rebuilt (``rebuilt``); numbers, strings and None are immutable and kept."""
    return rebuilt(state, _host_copy)


def _host_copy(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    return value.clone() if value.device.type == "cpu" else value.to("cpu")


WRITER_NICENESS = 19  # the writer thread's nice value: the loop's thread is woken first


class BackgroundWrites:
    """At most one write in flight, run by a writer thread of this process; its error is raised by the next
    ``start`` or ``wait``.

    The thread is started once and waits for work: a thread started per save cost the loop its start-up and a
    switch of the GIL (about 8 ms, against 2 ms for the copy; bench.checkpoint_stall). It is a daemon, so an
    exit is never held by an idle writer; an exit handler waits for the write in flight instead (a normal exit,
    an exception's, and ``ddp_core.process.exit.leave``, which runs the exit handlers).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[], None]) -> None:
        """Wait for the write in flight (raising its error), then hand ``write`` to the writer thread."""
        self.wait()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="ddp_lab checkpoint writer", daemon=True)
            self._thread.start()
            atexit.register(self._idle.wait)
        self._idle.clear()
        self._jobs.put(write)

    def _serve(self) -> None:
        try:  # Linux: this thread alone yields the CPU to the training loop (a write is never urgent)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            write = self._jobs.get()
            try:
                write()
            except BaseException as error:  # kept for the caller: a thread's exception would only be printed
                self._error = error
            finally:
                self._idle.set()

    def wait(self) -> None:
        """Return once no write is in flight; raise the error of the last one, if it failed."""
        self._idle.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def in_flight(self) -> bool:
        return not self._idle.is_set()


WRITES = BackgroundWrites()  # this process's: global rank 0 writes a run's checkpoints, one run per process
