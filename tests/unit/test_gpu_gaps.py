"""bench.gpu_gaps: the GPU's busy share and its idle gaps charged to what the host was doing, on a made-up trace
whose every number is known (a real CUDA trace needs a GPU; the tool's GPU use is recorded in docs/benchmarks.md)."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import gpu_gaps
from ddp_core.training.profiling import PAUSE_ANNOTATION

HOST = (1, 1)  # (pid, tid): the main thread


def op(name: str, start: float, end: float, category: str = "cpu_op", where: tuple = HOST) -> dict:
    return {"ph": "X", "cat": category, "name": name, "pid": where[0], "tid": where[1], "ts": start, "dur": end - start}


def kernel(start: float, end: float, correlation: int, category: str = "kernel", stream: int = 7) -> dict:
    return {**op(f"k{correlation}", start, end, category, (0, stream)), "args": {"correlation": correlation}}


def launch(at: float, correlation: int) -> dict:
    return {**op("cudaLaunchKernel", at, at + 1, "cuda_runtime"), "args": {"correlation": correlation}}


EVENTS = [
    op("ProfilerStep#1", 0, 1000, "user_annotation"),  # encloses everything: never the answer
    op("aten::conv2d", 10, 50),
    launch(20, 1),
    kernel(30, 100, 1),
    op("Optimizer.step#SGD.step", 140, 450, "user_annotation"),
    op("aten::_fused_sgd_", 150, 400),  # the innermost at 380: aten::empty ended before it
    op("aten::empty", 375, 379),
    launch(380, 2),
    kernel(390, 500, 2),  # idle 100 -> 390, launched at 380, after the gap began: the host was late
    launch(200, 3),
    kernel(600, 700, 3),  # idle 500 -> 600, launched at 200, long before: the GPU waited on something else
    launch(650, 4),
    kernel(650, 720, 4, "gpu_memcpy", stream=8),  # overlaps k3 and k5 on another stream: one busy span
    launch(690, 5),
    kernel(702, 800, 5),
    launch(900, 6),
    kernel(903, 950, 6),  # idle 800 -> 903, launched at 900 outside any operation: charged to the launch itself
    kernel(960, 990, 99),  # no launch event for it: idle 950 -> 960
]


def test_idle_gaps_are_charged_to_the_operation_the_host_was_in_at_the_late_launch():
    found = gpu_gaps.gaps(EVENTS, min_gap_us=5)
    assert found.window_us == 990 - 30
    assert found.busy_us == 70 + 110 + 200 + 47 + 30
    assert found.steps == 1
    assert found.charged == {
        "aten::_fused_sgd_": (290, 1),
        gpu_gaps.BEFORE: (100, 1),
        "cudaLaunchKernel": (103, 1),
        gpu_gaps.UNKNOWN: (10, 1),
    }
    assert found.per_step == {1: (290 + 100 + 103, 3, 0)}  # every launch in step 1; k99 has none
    # why late: from each late gap's start to its launch, the host's outermost operations, and time in none
    assert found.during == {"Optimizer.step#SGD.step": 380 - 140, gpu_gaps.BETWEEN: (140 - 100) + (900 - 800)}


def test_gaps_under_the_threshold_are_idle_but_not_charged():
    found = gpu_gaps.gaps(EVENTS, min_gap_us=50)
    assert found.idle_us == 960 - 457
    assert found.charged == {"aten::_fused_sgd_": (290, 1), gpu_gaps.BEFORE: (100, 1), "cudaLaunchKernel": (103, 1)}


def test_the_command_reads_plain_and_gzipped_traces_and_refuses_a_missing_one(tmp_path, capsys):
    plain, packed = tmp_path / "a.json", tmp_path / "b.json.gz"
    plain.write_text(json.dumps({"traceEvents": EVENTS}))
    with gzip.open(packed, "wt") as file:
        json.dump({"traceEvents": [op("aten::add", 0, 5)]}, file)
    assert gpu_gaps.main(["--traces", f"{plain},{packed}", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{plain}: GPU busy 47.6% of 1.0 ms; idle 0.50 ms, 0.50 ms a step over 1 steps"
    assert [line.split()[-1] for line in lines[2:4]] == ["aten::_fused_sgd_", "cudaLaunchKernel"]
    assert lines[5:7] == ["     0.24         Optimizer.step#SGD.step", f"     0.14         {gpu_gaps.BETWEEN}"]
    assert lines[7:9] == ["  idle ms   gaps  launched in step (its pause, ms)", "     0.49      3  #1"]  # not k99's
    assert lines[9] == f"{packed}: no GPU events (a CPU trace, or a window without GPU work)"
    with pytest.raises(SystemExit) as stopped:
        gpu_gaps.main(["--traces", str(tmp_path / "missing.json")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path / 'missing.json'} is no file")
    plain.write_text("{not json")
    with pytest.raises(SystemExit) as stopped:
        gpu_gaps.main(["--traces", str(plain)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {plain} is not a Chrome trace (JSONDecodeError: ")


# Two steps; step 7 ends in the loop's pause (an evaluation's kernel in it), step 8 restarts the GPU late.
PAUSED = [
    op("ProfilerStep#7", 0, 1700, "user_annotation"),
    op("ProfilerStep#8", 1700, 3000, "user_annotation"),
    launch(10, 1),
    kernel(20, 400, 1),
    launch(390, 2),
    kernel(400, 600, 2),  # back to back with k1: one busy span
    op(PAUSE_ANNOTATION, 620, 1600, "user_annotation"),  # the loop synchronized: the GPU had no training work left
    launch(700, 3),
    kernel(710, 900, 3),  # launched in the pause: the evaluation's, not training
    kernel(1000, 1100, 98),  # no launch event, but run in the pause: not training either
    op("aten::index_select", 1650, 1800),
    launch(1790, 4),
    kernel(1800, 2000, 4),  # idle 600 -> 1800 less the pause's 980: 220, of it 200 after the pause (the restart)
    launch(2500, 5),
    kernel(2600, 2700, 5),  # idle 2000 -> 2600, launched late outside any operation
]


def test_the_loops_pauses_are_left_out_and_each_steps_idle_is_told():
    found = gpu_gaps.gaps(PAUSED, min_gap_us=5)
    assert (found.pauses, found.paused_us, found.restart_us) == (1, 980, 200)
    assert found.window_us == 2700 - 20 - 980  # training time, as the loop's clock counts it
    assert found.busy_us == 580 + 200 + 100  # the pause's kernels not among them
    assert found.charged == {"aten::index_select": (220, 1), "cudaLaunchKernel": (600, 1)}
    # what the host did while the GPU waited: from the pause's end on, not during it
    assert found.during == {"aten::index_select": 1790 - 1650, gpu_gaps.BETWEEN: (1650 - 1600) + (2500 - 2000)}
    assert found.per_step == {7: (0, 0, 980), 8: (820, 2, 0)}
    lines = gpu_gaps.report("t", found, top=1)
    assert lines[0] == "t: GPU busy 51.8% of 1.7 ms; idle 0.82 ms, 0.41 ms a step over 2 steps"
    assert lines[1] == (
        "  the loop's 1 pause(s) (log, evaluate, checkpoint: 1.0 ms) left out; from their ends to the next GPU work "
        "the GPU waited 0.20 ms"
    )
    assert lines[-2:] == ["  idle ms   gaps  launched in step (its pause, ms)", "     0.82      2  #8"]
    assert gpu_gaps.report("t", found, top=2)[-2:] == ["     0.00      0  #7 (paused 1.0)", "     0.82      2  #8"]


def test_a_trace_without_pauses_counts_the_whole_window():
    found = gpu_gaps.gaps([event for event in PAUSED if event["name"] != PAUSE_ANNOTATION], min_gap_us=5)
    assert (found.pauses, found.paused_us, found.restart_us) == (0, 0, 0)
    assert found.window_us == 2700 - 20
    assert found.busy_us == 580 + 190 + 100 + 200 + 100  # the evaluation's kernels are GPU work like any other
