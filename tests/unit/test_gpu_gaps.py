"""bench.gpu_gaps: the GPU's busy share and its idle gaps charged to what the host was doing, on a made-up trace
whose every number is known (a real CUDA trace needs a GPU; the tool's GPU use is recorded in docs/benchmarks.md)."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import gpu_gaps

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
    assert lines[7] == f"{packed}: no GPU events (a CPU trace, or a window without GPU work)"
    with pytest.raises(SystemExit) as stopped:
        gpu_gaps.main(["--traces", str(tmp_path / "missing.json")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path / 'missing.json'} is no file")
    plain.write_text("{not json")
    with pytest.raises(SystemExit) as stopped:
        gpu_gaps.main(["--traces", str(plain)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {plain} is not a Chrome trace (JSONDecodeError: ")
