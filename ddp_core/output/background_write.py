"""Checkpoint files written behind the training loop: the loop waits for a copy in host memory, not for the disk.

One write in flight at a time; its error (a full disk) is raised by the next ``start`` or ``wait``, which rank 0
calls inside ``rank0_decides``, so every rank stops at the same step (docs/benchmarks.md, "Checkpoint stall").
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
from collections.abc import Callable

WRITER_NICENESS = 19  # the writer thread's nice value: the loop's thread is woken first


class BackgroundWrites:
    """At most one write in flight, run by one long-lived writer thread (a thread per save stalled the loop): a
    daemon, so an idle writer never holds an exit; an exit handler waits for the write in flight instead."""

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
        with contextlib.suppress(AttributeError, OSError):  # Linux: this thread alone yields the CPU to the loop
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)  # a write is never urgent
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
