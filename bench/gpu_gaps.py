"""Where the GPU waited in a `--profile` trace: its busy share and, for its idle gaps, what the host was doing.

    python -m bench.gpu_gaps --traces runs/cifar10/A/profile/rank0.json     # one trace
    python -m bench.gpu_gaps --traces bare.json.gz,run.json.gz --top 5      # two, one after the other

A trace is Chrome's format as torch.profiler writes it (`--profile START:STEPS`; `.json` or `.json.gz`). The GPU is
busy while any kernel, copy or memset runs, on any stream; its window runs from the first such event to the last.
An idle gap ends with the next GPU event. When the host launched that event after the gap had begun, the GPU was
waiting for the host, and the gap is charged to the operation the host was in at the launch (the innermost
``aten::`` operation or annotation enclosing the launch on its thread): the first table sums the gaps per operation.
The second says why the launch came late: what the host did from the gap's start to the launch, summed per
outermost operation on that thread (time in none of them is Python between operations, e.g. a training loop's own).
When the launch came before the gap, the GPU waited on something else (a stream's wait on another, a
synchronization): those gaps are summed as "launched before the gap". Gaps under --min-gap microseconds (the
launch-to-launch spacing of back-to-back kernels) are counted in the idle total but not charged.

The training loop marks its pauses in the trace (``ddp_lab.pause``: logging, evaluating, checkpointing, which its
clock leaves out of the throughput; it synchronizes first, so the GPU has no training work left then). Here too they
are left out: the window is training time, the pauses' own GPU work (an evaluation) is not counted, and the idle
from a pause's end to the next GPU work, the restart, is charged like any other gap and summed apart. Last, per
step (``ProfilerStep#N``): the idle charged to the launches made in it, and its pause.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddp_core.config import option, require
from ddp_core.errors import ConfigError
from ddp_core.process.entry import command_main
from ddp_core.training.profiling import PAUSE_ANNOTATION

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
BEFORE = "(launched before the gap: a wait on another stream or event)"
UNKNOWN = "(no launch event for it in the trace)"
BETWEEN = "(between operations: Python, or a thread the profiler does not see)"


@dataclass
class GpuGapsArgs:
    traces: str = option("", "Chrome trace files (.json or .json.gz), comma-separated")
    top: int = option(10, "host operations listed per trace, the largest idle first", minimum=1)
    min_gap: float = option(5.0, "microseconds: shorter gaps are counted as idle but not charged", minimum=0)


@dataclass(frozen=True)
class Gaps:
    window_us: float  # from the first training GPU event to the last, the loop's pauses left out
    busy_us: float
    steps: int  # ProfilerStep annotations in the trace
    charged: dict[str, tuple[float, int]]  # host operation at the late launch -> (idle microseconds, gaps)
    during: dict[str, float]  # host's outermost operation -> microseconds of it while the GPU waited for the host
    per_step: dict[int, tuple[float, int, float]] = field(default_factory=dict)  # N -> (idle us, gaps, paused us)
    pauses: int = 0  # the loop's pauses inside the window
    paused_us: float = 0.0
    restart_us: float = 0.0  # idle from each pause's end to the next GPU work

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us


def load(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        return json.load(file)["traceEvents"]


def _merged(intervals: list[tuple[float, float, dict]]) -> list[tuple[float, float, dict]]:
    """Busy spans (start, end, the event that opened it), in order, overlapping events merged."""
    spans: list[tuple[float, float, dict]] = []
    for start, end, event in sorted(intervals, key=lambda item: item[0]):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end), spans[-1][2])
        else:
            spans.append((start, end, event))
    return spans


class _HostOps:
    """The host's operations per thread, to find the innermost one enclosing a moment."""

    def __init__(self, events: list[dict]) -> None:
        self.by_thread: dict[tuple, list[tuple[float, float, str]]] = collections.defaultdict(list)
        for event in events:
            if event.get("ph") == "X" and event.get("cat") in HOST_CATEGORIES and "dur" in event:
                if event["name"].startswith("ProfilerStep#"):
                    continue  # encloses everything: says nothing
                start = float(event["ts"])
                self.by_thread[(event.get("pid"), event.get("tid"))].append(
                    (start, start + float(event["dur"]), event["name"])
                )
        self.starts, self.longest, self.outermost, self.outer_starts = {}, {}, {}, {}
        for thread, ops in self.by_thread.items():
            ops.sort(key=lambda op: (op[0], -op[1]))  # an enclosing operation before those it encloses
            self.starts[thread] = [op[0] for op in ops]
            self.longest[thread] = max(end - start for start, end, _ in ops)
            outermost: list[tuple[float, float, str]] = []
            for op in ops:
                if not outermost or op[0] >= outermost[-1][1]:
                    outermost.append(op)
            self.outermost[thread] = outermost
            self.outer_starts[thread] = [op[0] for op in outermost]

    def innermost(self, thread: tuple, moment: float) -> str | None:
        """The latest-starting operation that still encloses ``moment``: with nested operations, the innermost."""
        ops = self.by_thread.get(thread, [])
        for index in range(bisect.bisect_right(self.starts.get(thread, []), moment) - 1, -1, -1):
            start, end, name = ops[index]
            if end >= moment:
                return name
            if start < moment - self.longest[thread]:
                return None  # no earlier operation lasts long enough to reach it
        return None

    def busy_in(self, thread: tuple, begin: float, end: float) -> dict[str, float]:
        """Microseconds of each outermost operation within [begin, end]; the rest as ``BETWEEN``."""
        spent: dict[str, float] = collections.defaultdict(float)
        ops = self.outermost.get(thread, [])
        index = max(bisect.bisect_right(self.outer_starts.get(thread, []), begin) - 1, 0)
        covered = 0.0
        for start, stop, name in ops[index:]:
            if start >= end:
                break
            overlap = min(stop, end) - max(start, begin)
            if overlap > 0:
                spent[name] += overlap
                covered += overlap
        if end - begin - covered > 0:
            spent[BETWEEN] += end - begin - covered
        return spent


class _Intervals:
    """Host time intervals (the loop's pauses, the steps), sorted and apart, to find the one holding a moment."""

    def __init__(self, intervals: list[tuple[float, float, int]]) -> None:
        self.intervals = sorted(intervals)
        self.starts = [start for start, _, _ in self.intervals]

    def holding(self, moment: float) -> int | None:
        """The label of the interval that holds ``moment``, if any."""
        index = bisect.bisect_right(self.starts, moment) - 1
        if index >= 0 and moment <= self.intervals[index][1]:
            return self.intervals[index][2]
        return None

    def within(self, begin: float, end: float) -> tuple[float, float | None]:
        """Microseconds of the intervals within [begin, end], and the end of the last of them there (None: none)."""
        covered, last_end = 0.0, None
        for start, stop, _ in self.intervals[max(bisect.bisect_right(self.starts, begin) - 1, 0) :]:
            if start >= end:
                break
            overlap = min(stop, end) - max(start, begin)
            if overlap > 0:
                covered += overlap
                last_end = stop
        return covered, last_end


def _annotations(events: list[dict], wanted: Callable[[str], int | None]) -> _Intervals:
    """The host annotations whose name ``wanted`` labels (None: not one of them)."""
    found = []
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "user_annotation" and "dur" in event:
            label = wanted(event["name"])
            if label is not None:
                found.append((float(event["ts"]), float(event["ts"]) + float(event["dur"]), label))
    return _Intervals(found)


def _step_number(name: str) -> int | None:
    number = name.removeprefix("ProfilerStep#")
    return int(number) if number != name and number.isdigit() else None


def gaps(events: list[dict], min_gap_us: float = 5.0) -> Gaps:
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and isinstance(e.get("args"), dict) and "correlation" in e["args"]
    }
    pauses = _annotations(events, lambda name: 0 if name == PAUSE_ANNOTATION else None)
    marks = _annotations(events, _step_number)

    def launched(event: dict) -> dict | None:
        return launches.get((event.get("args") or {}).get("correlation"))

    def paused(event: dict) -> bool:  # launched in a pause: the pause's own work (an evaluation)
        launch = launched(event)
        return pauses.holding(float(launch["ts"]) if launch is not None else float(event["ts"])) is not None

    gpu = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e)
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and not paused(e)
    ]
    if not gpu:
        return Gaps(0.0, 0.0, len(marks.intervals), {}, {})
    host = _HostOps(events)
    spans = _merged(gpu)
    busy = sum(end - start - pauses.within(start, end)[0] for start, end, _ in spans)
    charged: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    during: dict[str, float] = collections.defaultdict(float)
    per_step: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    restart = 0.0
    for (_, previous_end, _), (start, _, event) in zip(spans, spans[1:]):
        in_pauses, pause_end = pauses.within(previous_end, start)
        idle = start - previous_end - in_pauses
        if pause_end is not None:
            restart += max(start - pause_end, 0.0)
        if idle < min_gap_us:
            continue
        launch = launched(event)
        if launch is None:
            name = UNKNOWN
        elif float(launch["ts"]) <= previous_end:
            name = BEFORE
        else:
            thread, at = (launch.get("pid"), launch.get("tid")), float(launch["ts"])
            name = host.innermost(thread, at) or launch["name"]
            waited_from = previous_end if pause_end is None else max(previous_end, pause_end)
            for operation, us in host.busy_in(thread, waited_from, min(at, start)).items():
                during[operation] += us
        charged[name][0] += idle
        charged[name][1] += 1
        step = marks.holding(float(launch["ts"])) if launch is not None else None
        if step is not None:
            per_step[step][0] += idle
            per_step[step][1] += 1
    first, last = spans[0][0], spans[-1][1]
    paused_us, _ = pauses.within(first, last)
    for begin, end, step in marks.intervals:
        per_step[step][2] += pauses.within(begin, end)[0]
    return Gaps(
        last - first - paused_us,
        busy,
        len(marks.intervals),
        {name: (us, int(count)) for name, (us, count) in charged.items()},
        dict(during),
        {step: (idle, int(count), paused) for step, (idle, count, paused) in sorted(per_step.items())},
        sum(1 for begin, end, _ in pauses.intervals if begin < last and end > first),
        paused_us,
        restart,
    )


def report(name: str, found: Gaps, top: int) -> list[str]:
    if not found.window_us:
        return [f"{name}: no GPU events (a CPU trace, or a window without GPU work)"]
    per_step = f", {found.idle_us / found.steps / 1000:.2f} ms a step over {found.steps} steps" if found.steps else ""
    lines = [
        f"{name}: GPU busy {found.busy_us / found.window_us:.1%} of {found.window_us / 1000:.1f} ms; "
        f"idle {found.idle_us / 1000:.2f} ms{per_step}",
    ]
    if found.pauses:
        lines.append(
            f"  the loop's {found.pauses} pause(s) (log, evaluate, checkpoint: {found.paused_us / 1000:.1f} ms) left "
            f"out; from their ends to the next GPU work the GPU waited {found.restart_us / 1000:.2f} ms"
        )
    lines.append("  idle ms   gaps  the next GPU work was launched late, in")
    ranked = sorted(found.charged.items(), key=lambda item: -item[1][0])
    for operation, (idle_us, count) in ranked[:top]:
        lines.append(f"  {idle_us / 1000:7.2f} {count:6d}  {operation}")
    if found.during:
        lines.append("  idle ms         while the GPU waited, the host was in (outermost operations)")
        for operation, us in sorted(found.during.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"  {us / 1000:7.2f}         {operation}")
    if found.per_step:
        shown = sorted(sorted(found.per_step, key=lambda step: -found.per_step[step][0])[:top])
        lines.append("  idle ms   gaps  launched in step (its pause, ms)")
        for step in shown:
            idle_us, count, paused_us = found.per_step[step]
            pause = f" (paused {paused_us / 1000:.1f})" if paused_us else ""
            lines.append(f"  {idle_us / 1000:7.2f} {count:6d}  #{step}{pause}")
    return lines


def run_bench(args: GpuGapsArgs) -> int:
    paths = [path for path in args.traces.split(",") if path]
    require(bool(paths), "name a trace: python -m bench.gpu_gaps --traces RUN_DIR/profile/rank0.json")
    for path in paths:
        require(Path(path).is_file(), f"{path} is no file: pass a trace that --profile wrote (RUN_DIR/profile/)")
        try:
            events = load(path)
        except (OSError, ValueError, KeyError, TypeError) as error:  # not JSON, or JSON without traceEvents
            raise ConfigError(
                f"{path} is not a Chrome trace ({type(error).__name__}: {error}): pass one --profile wrote"
            )
        print("\n".join(report(path, gaps(events, args.min_gap), args.top)))
    return 0


main = command_main(GpuGapsArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
