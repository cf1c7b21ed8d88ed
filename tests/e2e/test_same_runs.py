"""``python -m ddp_core.runs --same A B`` on real toy runs at 2 processes: the same seed twice ends bitwise equal
(exit 0, one line), another seed differs (exit 1, a few lines naming the state and tensor); the manifest records
the toy's headline metric, which the runs table shows first; --compare lists the equal metrics too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.launch import run, torchrun

SMALL = ("--steps", "12", "--dataset-size", "256", "--log-every", "4", "--checkpoint-every", "6")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/toy/{a,b}: seed 0 twice; runs/toy/c: seed 1; runs/toy/resumed: seed 0 stopped at step 5, resumed."""
    root = tmp_path_factory.mktemp("same") / "runs"
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        torchrun(2, "experiments.toy", "--run-dir", str(root / "toy" / name), "--seed", seed, *SMALL)
    resumed = ("--run-dir", str(root / "toy" / "resumed"), *SMALL)
    torchrun(2, "experiments.toy", *resumed, "--stop-at-step", "5")  # mid-way between two checkpoints
    torchrun(2, "experiments.toy", *resumed, "--resume")
    return root


def runs_command(root: Path, *args: str):
    return run([sys.executable, "-m", "ddp_core.runs", str(root), *args], timeout=120)


@pytest.mark.parametrize("other", ["toy/b", "toy/resumed"])
def test_the_same_seed_twice_and_a_resumed_run_are_bitwise_the_same(runs: Path, other: str):
    result = runs_command(runs, "--same", "toy/a", other)
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.strip()
    assert "\n" not in line and line.startswith("the same: the last checkpoints (step 12) are bitwise equal")
    for state in ("model", "optimizer", "position", "rng", "metrics"):
        assert state in line


def train_loss_points(run_dir: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars("train/loss")]


def test_a_run_resumed_mid_interval_logs_the_same_loss_points(runs: Path):
    """Stopped at step 5, between the points at 4 and 8: the checkpoint holds the interval so far, so the resumed
    run's point at 8 is the mean of steps 5 to 8 on both ranks, as the uninterrupted run's, to the bit."""
    points = train_loss_points(runs / "toy" / "a")
    assert [step for step, _ in points] == [4, 8, 12]
    assert train_loss_points(runs / "toy" / "resumed") == points


def test_another_seed_differs_in_a_few_lines_naming_the_state_and_tensor(runs: Path):
    result = runs_command(runs, "--same", "toy/a", "toy/c")
    assert result.returncode == 1 and not result.stderr.strip(), result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) <= 4 and lines[0].startswith("different: the last checkpoints (step 12) differ in")
    assert lines[1].startswith("  first: state 'model', net1.weight: torch.float32") and "the largest by" in lines[1]


def test_the_toy_declares_its_final_loss_as_headline_and_the_table_shows_it_first(runs: Path):
    assert json.loads((runs / "toy" / "a" / "manifest.json").read_text())["headline"] == ["final_loss"]
    table = runs_command(runs).stdout.splitlines()
    row = next(line for line in table if line.startswith("toy/a "))
    assert row.split("  ")[-1].split()[0].startswith("final_loss=")


def test_compare_lists_the_equal_metrics_too(runs: Path):
    out = runs_command(runs, "--compare", "toy/a", "toy/b").stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["final_loss"][-1] == "same" and rows["steps"][1:] == ["12", "12", "same"]
