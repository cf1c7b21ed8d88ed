"""Where the time and the bytes go, per rank, in real runs through the project's launcher.

A 3-process toy whose rank 2 sleeps in every optimizer step from step 16 on (tests/e2e/faulty.py's ``slow``
fault) names rank 2 once, within three log intervals of the slowing and not before it; metrics.json, TensorBoard
and the runs table hold the per-rank times. An even 2-process run (with the fp16 hook, for its byte count) names
no rank.

The rule names a rank on its third slow interval in a row (tests/unit/test_slow_rank.py counts them exactly). In a
real run on a loaded machine the intervals just before the slowing can read slow too (the OS delayed that rank's
steps): the rank is then named on its first or second slow interval, as it would be in a real job. So the test
takes any interval after the slowing up to its third; three even intervals come first, so a false alarm before
the slowing fails it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core.runs import read_run, slowest_rank
from tests.e2e.launch import run, torchrun_command

LOG_EVERY, SLOW_FROM, SLEEP_S = 5, 16, 0.02
FLAGS = ("--dataset-size", "512", "--log-every", str(LOG_EVERY), "--checkpoint-every", "0")
NAMED = re.compile(
    r"WARNING rank (\d+) \(host (\S+)\) is slow: its compute time per step is ([\d.]+)x .* at step (\d+),"
)


def launch(run_dir: Path, nproc: int, steps: int, *extra: str, **env: str) -> str:
    module = ("tests.e2e.faulty", "experiments.toy") if env else ("experiments.toy",)
    args = ("--run-dir", str(run_dir), "--steps", str(steps), *FLAGS, *extra)
    result = run(torchrun_command(nproc, *module, *args, launcher="ddp_core.torchrun"), timeout=240, **env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("slow") / "run"
    fault = {"FAULT": "slow", "FAULT_RANK": "2", "FAULT_STEP": str(SLOW_FROM), "FAULT_DELAY_S": str(SLEEP_S)}
    return run_dir, launch(run_dir, 3, 40, **fault)


@pytest.fixture(scope="module")
def even_run(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("even") / "run"
    return run_dir, launch(run_dir, 2, 60, "--comm-hook", "fp16")


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(next(run_dir.rglob("events.out.tfevents.*"))), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
        if tag.startswith("time/")
    }


def test_a_slow_rank_is_named_once_within_three_log_intervals(slow_run):
    run_dir, output = slow_run
    named = NAMED.findall(output)
    assert len(named) == 1, output[-3000:]
    rank, host, ratio, step = named[0]
    assert rank == "2" and float(ratio) > 1.25
    assert SLOW_FROM - 1 < int(step) <= SLOW_FROM - 1 + 3 * LOG_EVERY  # after the slowing, by its third interval
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert host in manifest["hosts"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    expected = {"rank": 2, "host": host, "ratio": pytest.approx(float(ratio), abs=0.006), "step": int(step)}
    assert metrics["slow_ranks_named"] == [expected]


def test_metrics_json_and_the_runs_table_hold_the_per_rank_times(slow_run):
    run_dir, _ = slow_run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    compute, wait = metrics["compute_s_by_rank"], metrics["comm_wait_s_by_rank"]
    assert len(compute) == len(wait) == 3
    assert compute[2] >= (40 - SLOW_FROM + 1) * SLEEP_S  # its sleep is its compute
    assert metrics["slowest_rank"] == 2 and metrics["slowest_rank_ratio"] > 1.25
    assert min(wait[:2]) > wait[2]  # the others wait for it
    assert metrics["comm_bytes_per_step"] == 660  # no hook: DDP's one bucket of the toy's 165 float32 gradients
    assert slowest_rank(read_run(run_dir, "run").metrics) == f"2 ({metrics['slowest_rank_ratio']:.2f}x)"


def test_tensorboard_holds_each_ranks_compute_and_wait_per_interval(slow_run):
    run_dir, _ = slow_run
    found = scalars(run_dir)
    steps = list(range(LOG_EVERY, 41, LOG_EVERY))
    assert sorted(found) == sorted(f"time/{kind}_rank{r}" for kind in ("compute", "comm_wait") for r in range(3))
    assert all([step for step, _ in points] == steps for points in found.values())
    slowed = [value for step, value in found["time/compute_rank2"] if step > SLOW_FROM - 1]
    assert all(value >= SLEEP_S for value in slowed)  # seconds per step, the sleep included
    waited = [value for rank in (0, 1) for step, value in found[f"time/comm_wait_rank{rank}"] if step > SLOW_FROM - 1]
    assert all(value > SLEEP_S / 2 for value in waited)


def test_an_even_run_names_no_rank(even_run):
    run_dir, output = even_run
    assert " is slow: " not in output
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["slow_ranks_named"] == [] and len(metrics["compute_s_by_rank"]) == 2
    assert metrics["comm_bytes_per_step"] == 330  # fp16: the compressed buffer, 2 bytes a gradient
    assert sorted(scalars(run_dir)) == sorted(f"time/{k}_rank{r}" for k in ("compute", "comm_wait") for r in range(2))
