"""``--profile START:STEPS``: each rank's ``torch.profiler`` trace of steps START..START+STEPS-1 (named by the run's
count) and on CUDA a memory snapshot of the step after, in the run directory (docs/decisions.md, "Profiling a
window of steps")."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from ddp_core.config import option
from ddp_core.ranks import THIS_RANK

log = logging.getLogger(__name__)
FORM = "START:STEPS, two integers >= 1 (e.g. 10:5, steps 10 to 14)"
TOP_OPERATIONS = 15
MEMORY_EVENTS = 100_000  # the allocator events a snapshot keeps: enough for a few steps of a large model
PAUSE_ANNOTATION = "ddp_lab.pause"  # the loop's pauses in a trace: their time is not training time


@dataclass(frozen=True)
class Window:
    """Optimizer steps ``first``..``last`` (both included), as the run counts them."""

    first: int
    steps: int

    @property
    def last(self) -> int:
        return self.first + self.steps - 1

    def __str__(self) -> str:
        return f"{self.first}:{self.steps}"

    @classmethod
    def parse(cls, value: str) -> Window | None:
        """``START:STEPS``; None for "" (off) and for anything else."""
        match = re.fullmatch(r"([0-9]+):([0-9]+)", value)
        return None if match is None or int(match[1]) < 1 or int(match[2]) < 1 else cls(int(match[1]), int(match[2]))


def window_problem(value: str) -> str | None:
    if Window.parse(value) is not None:
        return None
    return "counts from step 1" if re.fullmatch(r"[0-9]+:[0-9]+", value) else "is not START:STEPS"


@dataclass
class ProfileArgs:
    """The option of the profile window (a mixin of the shared training options)."""

    profile: str = option(
        "",
        "record a torch.profiler trace of optimizer steps START to START+STEPS-1 on every rank into the run "
        "directory's profile/, log each rank's top operations (docs/experiments.md); empty: off",
        check=window_problem,
        accepts=FORM,
        computation=False,
    )


class Clock(Protocol):
    """What counts training time (``MetricsLog``): paused while the profiler starts and writes its files."""

    def pause_clock(self) -> None: ...

    def resume_clock(self) -> None: ...


class StepProfiler:
    """Opens the window before its first step's work (``begin_step``) and closes it after its last (``end_step``,
    ``close``); does nothing when off."""

    def __init__(
        self, value: str, done_steps: int, device: torch.device, rank: int, trace: Path, memory: Path, clock: Clock
    ) -> None:
        self.window = Window.parse(value) if value else None
        self.device, self.rank, self.trace, self.memory, self.clock = device, rank, trace, memory, clock
        self._profiler: Any = None
        self._memory_open = False  # CUDA: the step after the window runs, its allocations recorded
        self._steps = (0, 0)  # the first and the last step done inside the window
        self._until = self.window.last if self.window is not None else 0
        if self.window is not None and self.window.last <= done_steps:
            why = "this run resumes after step %d, past the window: nothing is profiled"
            log.warning("--profile=%s: " + why, self.window, done_steps)
            self.window = None

    @property
    def recording(self) -> bool:
        """The trace is being recorded (the window's steps)."""
        return self._profiler is not None

    def begin_step(self, step: int) -> None:
        """Step ``step``'s work begins: the window opens if it is the window's first step still to come."""
        window = self.window
        if window is None or self.recording or not window.first <= step <= window.last:
            return
        self._pausing(self._start, step)

    def end_step(self, step: int, last: bool) -> None:
        """After ``loop.step``: the window closes after its last step (or the run's); else the next step begins."""
        if self._memory_open:
            self._pausing(self._dump_memory)
        elif self.recording:
            self._steps = (self._steps[0], step)
            if step >= self._until or last:
                self._pausing(self._stop, not last)
            else:
                self._profiler.step()  # ProfilerStep#step ends, #step+1 begins
        elif not last:
            self.begin_step(step + 1)

    def close(self) -> None:
        """Stop and write the files, once (a run that ends or stops inside the window, or right after it)."""
        if self._memory_open:
            self._pausing(self._dump_memory)
        elif self.recording:
            self._pausing(self._stop, False)

    def _pausing(self, work: Any, *args: Any) -> None:
        self.clock.pause_clock()
        try:
            work(*args)
        finally:
            self.clock.resume_clock()

    def _start(self, step: int) -> None:
        if self.device.type == "cpu":  # else a CUDA build of torch on a host without GPUs logs a false ERROR line
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])]
        # A schedule that always records: with one, torch marks each step (ProfilerStep#N) in the trace.
        self._profiler = profile(
            activities=activities, schedule=lambda step: ProfilerAction.RECORD, record_shapes=False, with_stack=False
        )
        self._profiler.step_num = step  # the marks count as the run does
        self._steps = (step, step - 1)
        self._profiler.start()

    def _stop(self, memory_next: bool) -> None:
        """The trace's end; on CUDA the memory snapshot's start (``memory_next``), else the allocator's state now."""
        profiler, self._profiler = self._profiler, None
        self.window = None
        profiler.stop()
        steps = "{}..{}".format(*self._steps)
        self._write(self.trace, profiler.export_chrome_trace)
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATIONS)
        by = sort_by.removesuffix("_total").replace("_", " ")
        what = f"profile of steps {steps} on rank {self.rank}: {self.trace} (Perfetto opens it)"
        log.info("%s; its top %d operations by %s:\n%s", what, TOP_OPERATIONS, by, table, extra=THIS_RANK)
        if self.device.type != "cuda":
            return
        if memory_next:
            record_memory_history(max_entries=MEMORY_EVENTS)
            self._memory_open = True
        else:
            self._write(self.memory, dump_memory_snapshot)

    def _dump_memory(self) -> None:
        self._memory_open = False
        try:
            self._write(self.memory, dump_memory_snapshot)
        finally:
            record_memory_history(enabled=None)  # the allocator's record ends with the snapshot

    def _write(self, path: Path, write: Callable[[str], None]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(str(path))
        except OSError as error:  # a diagnostic: a full disk is the next checkpoint's to report
            log.warning("--profile: rank %d could not write %s: %s", self.rank, path, error, extra=THIS_RANK)


def record_memory_history(**options: Any) -> None:
    """torch's documented switch for the CUDA allocator's record, under a private name (a test replaces this one)."""
    torch.cuda.memory._record_memory_history(**options)


def dump_memory_snapshot(path: str) -> None:
    """The allocator's record so far, in the file ``path`` (pytorch.org/memory_viz opens it)."""
    torch.cuda.memory._dump_snapshot(path)
