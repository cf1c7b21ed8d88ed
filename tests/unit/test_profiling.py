"""--profile START:STEPS (ddp_core/training/profiling.py): the flag's form, which steps the window holds (driven as
the loop drives it), the files, the summary, the clock, and on CUDA the order of the memory snapshot's calls.
A profiled 2-process run against an unprofiled one: tests/e2e/test_toy.py."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_core.config import parse_args
from ddp_core.errors import AgreedConfigError, ConfigError
from ddp_core.experiment import TrainingArgs
from ddp_core.lifecycle.plan import make_plan
from ddp_core.training import profiling
from ddp_core.training.profiling import StepProfiler, Window


@dataclass
class Args(TrainingArgs):
    pass


class Clock:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def pause_clock(self) -> None:
        self.calls.append("pause")

    def resume_clock(self) -> None:
        self.calls.append("resume")


def profiler(tmp_path: Path, value: str, calls: list[str], done: int = 0, device: str = "cpu"):
    folder = tmp_path / "profile"
    return StepProfiler(
        value, done, torch.device(device), 1, folder / "rank1.json", folder / "memory_rank1.pickle", Clock(calls)
    )


def drive(prof: StepProfiler, first: int, last: int, end: int, calls: list[str]) -> None:
    """Steps first..last as the loop drives them: begin_step as a step's batch is handed out, end_step after
    loop.step (``end``: the run's last step, or a stop)."""
    model = nn.Linear(4, 1)
    for step in range(first, last + 1):
        prof.begin_step(step)
        calls.append(f"step {step}{' profiled' if prof.recording else ''}")
        model(torch.ones(2, 4)).sum().backward()
        prof.end_step(step, last=step == end)


def profiler_steps(trace: Path) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


@pytest.mark.parametrize("value", ["3:2", "1:1", "10:100"])
def test_the_flag_takes_start_and_steps(value):
    args = parse_args(Args, ["--profile", value])
    assert str(Window.parse(args.profile)) == value
    assert parse_args(Args, []).profile == ""  # off by default


@pytest.mark.parametrize("value", ["abc", "3", "0:2", "3:0", "-1:2", "3:2:1", "3:-2", " 3:2", "1.5:2", "٣:2"])
def test_a_malformed_window_is_one_line_naming_the_flag_and_the_form(value):
    with pytest.raises(ConfigError) as refused:
        parse_args(Args, [f"--profile={value}"])
    message = str(refused.value)
    assert "\n" not in message and "--profile" in message and "START:STEPS" in message, message


def test_the_window_holds_its_steps_and_its_trace_is_written_with_the_clock_paused(tmp_path, caplog):
    calls: list[str] = []
    prof = profiler(tmp_path, "3:2", calls)
    with caplog.at_level(logging.INFO, logger=profiling.__name__):
        drive(prof, 1, 6, 6, calls)
    # opened at the end of step 2 (step 3's batch is fetched inside), closed after step 4, each with the clock paused
    assert calls == [
        "step 1",
        "step 2",
        "pause",
        "resume",
        "step 3 profiled",
        "step 4 profiled",
        "pause",
        "resume",
        "step 5",
        "step 6",
    ]
    assert profiler_steps(tmp_path / "profile" / "rank1.json") == ["ProfilerStep#3", "ProfilerStep#4"]
    assert not (tmp_path / "profile" / "memory_rank1.pickle").exists()  # CUDA only
    (record,) = [r for r in caplog.records if r.name == profiling.__name__]
    assert record.this_rank and "profile of steps 3..4 on rank 1" in record.getMessage()
    assert "self cpu time" in record.getMessage() and "Self CPU" in record.getMessage()  # the table


def test_a_window_from_step_1_opens_with_the_first_batch(tmp_path):
    calls: list[str] = []
    drive(profiler(tmp_path, "1:1", calls), 1, 3, 3, calls)
    assert calls == ["pause", "resume", "step 1 profiled", "pause", "resume", "step 2", "step 3"]
    assert profiler_steps(tmp_path / "profile" / "rank1.json") == ["ProfilerStep#1"]


def test_a_run_that_ends_inside_the_window_writes_the_trace(tmp_path):
    calls: list[str] = []
    drive(profiler(tmp_path, "2:10", calls), 1, 3, 3, calls)  # the run's last step is 3
    assert profiler_steps(tmp_path / "profile" / "rank1.json") == ["ProfilerStep#2", "ProfilerStep#3"]


def test_a_loop_left_inside_the_window_writes_it_at_close(tmp_path, caplog):
    calls: list[str] = []
    prof = profiler(tmp_path, "2:10", calls)
    drive(prof, 1, 3, 0, calls)  # the experiment broke out of its loop after step 3
    assert prof.recording
    with caplog.at_level(logging.INFO, logger=profiling.__name__):
        prof.close()
        prof.close()  # once
    # ProfilerStep#4: from step 3's end to the close (the loop's end)
    assert profiler_steps(tmp_path / "profile" / "rank1.json") == [f"ProfilerStep#{n}" for n in (2, 3, 4)]
    (record,) = [r for r in caplog.records if r.name == profiling.__name__]
    assert "profile of steps 2..3 on rank 1" in record.getMessage()


def test_a_resumed_run_counts_on_and_profiles_what_is_left_of_the_window(tmp_path):
    calls: list[str] = []
    drive(profiler(tmp_path, "3:3", calls, done=3), 4, 7, 7, calls)  # resumed after step 3
    assert profiler_steps(tmp_path / "profile" / "rank1.json") == ["ProfilerStep#4", "ProfilerStep#5"]


def test_a_window_past_the_resumed_step_is_a_warning(tmp_path, caplog):
    calls: list[str] = []
    prof = profiler(tmp_path, "3:2", calls, done=4)
    drive(prof, 5, 6, 6, calls)
    assert calls == ["step 5", "step 6"] and not (tmp_path / "profile").exists()
    assert "past the window: nothing is profiled" in caplog.text


def plan(profile: str):
    """The plan of a 10-step run: where a window is judged against the run's length, before the run directory."""
    lengths = dict(total_steps=10, epochs=None, steps_per_epoch=None, batch_size=4, world_size=2, grad_accum=1)
    return make_plan(
        None, **lengths, per_epoch=False, evaluate=None, unit="samples", stop_at_step=0, eval_every=0, profile=profile
    )


def test_a_window_beyond_the_run_is_refused_by_the_plan():
    with pytest.raises(AgreedConfigError, match=r"^--profile=11:1 starts beyond the run's 10 steps"):
        plan("11:1")
    assert plan("10:5").total_steps == 10  # it may end beyond: it stops with the run


class FakeProfile:
    def __init__(self, calls: list[str], **options) -> None:
        self.calls, self.options, self.step_num = calls, options, 0
        activities = "+".join(a.name for a in options["activities"])
        calls.append(f"profile({activities}, shapes={options['record_shapes']}, stack={options['with_stack']})")

    def start(self) -> None:
        self.calls.append(f"start at {self.step_num}")

    def step(self) -> None:
        self.step_num += 1

    def stop(self) -> None:
        self.calls.append("stop")

    def export_chrome_trace(self, path: str) -> None:
        self.calls.append(f"export {Path(path).name}")

    def key_averages(self):
        calls = self.calls

        class Table:
            def table(self, sort_by: str, row_limit: int) -> str:
                calls.append(f"table by {sort_by}, {row_limit} rows")
                return ""

        return Table()


def fake_cuda(monkeypatch, calls: list[str]) -> None:
    """No GPU here: torch.cuda.memory's calls and the profiler are recorded, in order."""
    monkeypatch.setattr(profiling, "profile", lambda **options: FakeProfile(calls, **options))
    monkeypatch.setattr(
        profiling,
        "record_memory_history",
        lambda enabled="all", **kw: calls.append(f"history {enabled} max={kw.get('max_entries')}"),
    )
    monkeypatch.setattr(profiling, "dump_memory_snapshot", lambda path: calls.append(f"dump {Path(path).name}"))


TRACE = [
    "pause",
    "profile(CPU+CUDA, shapes=False, stack=False)",
    "start at 2",
    "resume",
    "step 2",
    "step 3",
    "pause",
    "stop",
    "export rank1.json",
    "table by self_device_time_total, 15 rows",
]
MEMORY = [f"history all max={profiling.MEMORY_EVENTS}", "resume", "step 4", "pause", "dump memory_rank1.pickle"]


@pytest.mark.parametrize(
    ("end", "left_at", "after_trace"),
    [
        # the step after the window is the snapshot's: its history is not recorded inside the traced steps
        (6, None, [*MEMORY, "history None max=None", "resume", "step 5", "step 6"]),
        (4, None, [*MEMORY, "history None max=None", "resume"]),  # the run's last step is the snapshot's
        # the run ends with the window: no step follows, the allocator's state without a history
        (3, None, ["dump memory_rank1.pickle", "resume"]),
        # the loop is left right after the window: the close writes what the next step had recorded so far
        (
            0,
            3,
            [
                f"history all max={profiling.MEMORY_EVENTS}",
                "resume",
                "close",
                "pause",
                "dump memory_rank1.pickle",
                "history None max=None",
                "resume",
            ],
        ),
    ],
)
def test_on_cuda_the_memory_snapshot_is_the_step_after_the_trace(tmp_path, monkeypatch, end, left_at, after_trace):
    calls: list[str] = []
    fake_cuda(monkeypatch, calls)
    prof = profiler(tmp_path, "2:2", calls, device="cuda")
    for step in range(1, (left_at or end) + 1):
        prof.begin_step(step)
        calls.append(f"step {step}")
        prof.end_step(step, last=step == end)
    calls.append("close")
    prof.close()
    prof.close()  # once
    assert calls == ["step 1", *TRACE, *after_trace, *([] if left_at else ["close"])]
