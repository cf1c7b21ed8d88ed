"""bench.step_overhead end to end on CPU (the small CNN, one process, tiny sizes): its plumbing, not its figures.

One run feeds every assertion: the four rows of the eager mode, each a median of its samples with their range,
each ratio to the bare step the median of the row's paired ratios (each sample over the bare pass measured beside
it), and (d) read from the experiment's own steady-state epochs, each between the bare passes timed while its run
paused after the epoch before's training steps and after its own.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest
import torch

from bench.step_overhead import ROW_NAMES, StepOverheadArgs, experiment_threads, resolve, steady_epochs
from ddp_core.errors import ConfigError
from tests import prefork
from tests.e2e.launch import REPO, clean_env


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[list[dict], str]:
    out = tmp_path_factory.mktemp("step_overhead") / "rows.json"
    command = [prefork.python(), "-m", "bench.step_overhead", "--repeats", "2", "--runs", "1", "--epochs", "3"]
    command += ["--train-images", "256", "--batch-size", "32", "--json", str(out), "--experiment-args=--log-every 5"]
    done = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_each_row_is_a_median_with_its_range_and_a_ratio_to_the_bare_step(bench):
    rows, printed = bench
    assert [row["name"] for row in rows] == [f"eager {name}" for name in ROW_NAMES.values()]
    bare = rows[0]
    for row in rows:
        samples = sorted(row["samples"])
        assert row["min"] == samples[0] <= row["images_per_s"] <= samples[-1] == row["max"]
        assert len(row["paired_ratios"]) == len(row["samples"])
        assert row["ratio"] == pytest.approx(statistics.median(row["paired_ratios"]))
        assert row["ratio_min"] == min(row["paired_ratios"]) <= row["ratio"] <= max(row["paired_ratios"])
        assert row["ratio_to_best_bare"] == pytest.approx(row["images_per_s"] / bare["images_per_s"])  # one mode
        assert row["name"] in printed
    assert "one process of 1 torch thread(s)" in printed  # the test's environment: OMP_NUM_THREADS=1
    assert "(d) runs with --log-every 5" in printed
    # (a): 2 repeats and one pass in each of the run's 3 pauses; (d): the 2 epochs after its run's warm-up
    assert [len(row["samples"]) for row in rows] == [5, 2, 2, 2]
    assert bare["paired_ratios"] == [1.0] * 5
    # (a)'s passes in order: the first repeat's, the three in the run's pauses, the second repeat's
    first, *paused, second = bare["samples"]
    loader = rows[1]  # each (b) over its own repeat's (a)
    assert loader["paired_ratios"] == pytest.approx([loader["samples"][0] / first, loader["samples"][1] / second])
    run = rows[3]  # each steady epoch over the mean of the passes timed right before and right after its steps
    expected = [epoch / ((before + after) / 2) for epoch, before, after in zip(run["samples"], paused, paused[1:])]
    assert run["paired_ratios"] == pytest.approx(expected)


def test_the_experiments_warm_up_epoch_is_left_out():
    output = "epoch 1/3  step 8  eval accuracy 0.5  100 images/s (warm-up)\nepoch 2/3  step 16  300 images/s\n"
    assert steady_epochs(output + "epoch 3/3  step 24  eval accuracy 0.9  310 images/s\n") == [300.0, 310.0]


@pytest.mark.parametrize(
    "modes, words", [("compile", "CUDA only"), ("eager,warp", "names ['warp']"), ("", "names ['']")]
)
def test_modes_cpu_cannot_measure_are_refused_in_one_line(modes: str, words: str):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        resolve(StepOverheadArgs(modes=modes), cuda=False)


@pytest.mark.parametrize(
    "flags, says",
    [
        ("--no-such-flag", "experiments.cifar10 says: "),
        ("--epochs two", "experiments.cifar10 says: "),
        ("--batch-size", "experiments.cifar10 says: "),
        ("--log-every '5", "close the quote"),
    ],
)
def test_flags_the_experiment_refuses_are_refused_before_anything_runs(flags: str, says: str):
    with pytest.raises(ConfigError, match=r"--experiment-args=.*" + re.escape(says)):
        resolve(StepOverheadArgs(experiment_args=flags), cuda=False)


@pytest.mark.parametrize("variable", ["1", None])
def test_the_in_process_rows_get_the_threads_the_experiments_worker_starts_with(monkeypatch, variable):
    """In `make bench` earlier benchmarks leave one thread set: (a)-(c) must not run at one against (d) at more."""
    before = torch.get_num_threads()
    if variable is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", variable)
    fresh = subprocess.run(  # a real fresh interpreter, as the experiment's worker starts
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
    )
    torch.set_num_threads(2 if variable == "1" else 1)  # what an earlier benchmark left
    try:
        threads = experiment_threads()
        assert threads == torch.get_num_threads() == int(fresh.stdout)
        assert variable is None or threads == int(variable)
    finally:
        torch.set_num_threads(before)
