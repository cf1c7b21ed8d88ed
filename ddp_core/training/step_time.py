"""Where one rank's step time goes: waiting (from autograd's last node to backward's return, and the run's own
collectives) or computing (the rest). Hooks read clocks only (docs/decisions.md, "Where the time and the bytes go,
per rank")."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable


class _HostClock:
    """perf_counter: the time the host spends, which is the step's on the CPU."""

    deferred = False

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class _CudaClock:
    """Events on the current stream: the host runs ahead of the GPU, so only the stream knows when a step ended."""

    deferred = True  # read once the events have completed (after the log interval's synchronize)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000


@dataclass
class _Step:
    start: Any
    waits: list[tuple[Any, Any]] = field(default_factory=list)  # (from, to) marks of each wait
    end: Any = None


@dataclass(frozen=True)
class StepTimes:
    """One rank's time over the steps since the last ``take``, in seconds."""

    compute_s: float = 0.0
    comm_wait_s: float = 0.0
    steps: int = 0
    quick_step_compute_s: float = 0.0  # its lower-quartile step: steps the OS delayed do not move it


def lower_quartile(values: list[float]) -> float:
    """The value a quarter of the way up (the smallest of 1-4 values, the 2nd smallest of 5-8, ...); 0 for none."""
    return sorted(values)[(len(values) - 1) // 4] if values else 0.0


class StepTimer:
    """This rank's compute and comm-wait time per optimizer step, measured around ``model``'s backward passes;
    ``on_synced_pass`` runs after each backward in which DDP all-reduced the gradients."""

    def __init__(
        self, model: nn.Module, device: torch.device, on_synced_pass: Callable[[], None] | None = None
    ) -> None:
        self._clock: Any = _CudaClock() if device.type == "cuda" else _HostClock()
        self._ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        self._on_synced_pass = on_synced_pass
        self._lock = threading.Lock()  # autograd may run a pass's hooks on a device thread
        # Without DDP (a world of one) backward waits on nobody: no hooks, each a Python call per parameter.
        self._handles = [
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)
            for parameter in (model.parameters() if self._ddp is not None else ())
            if parameter.requires_grad
        ]
        self._pass_synced = False
        self.restart()

    def restart(self) -> None:
        """Forget what was measured (set-up, a resume's settling step): a step starts now."""
        with self._lock:
            self._pass_open = False
        self._closed: list[_Step] = []
        self._computes: list[float] = []  # each step's compute since the last take
        self._comm_wait_s, self._marked = 0.0, 0  # _marked: closed steps that ``take(marked=True)`` hands over
        self.start_step()

    def start_step(self) -> None:
        self._current = _Step(self._clock.mark())

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a collective of the run's own: the time inside is spent waiting for the slowest rank."""
        began = self._clock.mark()
        try:
            yield
        finally:
            if self._current is not None:
                self._current.waits.append((began, self._clock.mark()))

    def end_step(self) -> None:
        step, self._current = self._current, None
        if step is None:
            return
        step.end = self._clock.mark()
        self._closed.append(step)
        if not self._clock.deferred:  # on the host: add it up now, keep no marks
            self._add_up()

    def mark(self) -> None:
        """The steps closed so far are what the next ``take(marked=True)`` hands over (a log point read late)."""
        self._marked = len(self._closed)

    def take(self, marked: bool = False) -> StepTimes:
        """The closed steps' totals since the last call (``marked``: those closed before the last ``mark``)."""
        self._add_up(self._marked if marked else len(self._closed))
        self._marked = 0
        computes = self._computes
        times = StepTimes(sum(computes), self._comm_wait_s, len(computes), lower_quartile(computes))
        self._computes, self._comm_wait_s = [], 0.0
        return times

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _add_up(self, count: int | None = None) -> None:
        """The first ``count`` closed steps (all: None) into the totals."""
        seconds = self._clock.seconds
        count = len(self._closed) if count is None else count
        for step in self._closed[:count]:
            waited = sum(seconds(start, end) for start, end in step.waits)
            self._computes.append(max(seconds(step.start, step.end) - waited, 0.0))
            self._comm_wait_s += waited
        del self._closed[:count]

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        with self._lock:
            if self._pass_open:
                return
            self._pass_open = True
            # DDP decided at forward whether this pass all-reduces; no_sync() is still around its backward
            self._pass_synced = self._ddp is not None and self._ddp.require_backward_grad_sync
        Variable._execution_engine.queue_callback(self._nodes_done)

    def _nodes_done(self) -> None:
        ready = self._clock.mark()  # every gradient is ready, every bucket handed to all-reduce
        Variable._execution_engine.queue_callback(lambda: self._backward_done(ready))  # runs after DDP's own

    def _backward_done(self, ready: Any) -> None:
        done = self._clock.mark()
        with self._lock:
            self._pass_open = False
            synced = self._pass_synced
        if self._current is not None:
            self._current.waits.append((ready, done))
        if synced and self._on_synced_pass is not None:
            self._on_synced_pass()
