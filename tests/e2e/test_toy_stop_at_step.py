"""The toy's --stop-at-step, as CIFAR10's: checkpoint and stop at that optimizer step, keeping the
schedule of --steps. That the stop writes no metrics.json and that --resume then ends bitwise-equal to the
uninterrupted run, at 2 and 3 processes, is the contract's `resume` property (tests/e2e/test_contract.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests import prefork
from tests.e2e.launch import run, torchrun

SMALL = ("--dataset-size", "512", "--log-every", "10", "--batch-size", "16")


def test_stop_at_step_beyond_steps_is_one_line_exit_2(tmp_path: Path):
    result = run(
        [
            prefork.python(),
            "-m",
            "experiments.toy",
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            "10",
            "--stop-at-step",
            "11",
        ]
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "--stop-at-step=11" in lines[0] and "--steps=10" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_stop_at_the_last_step_is_the_normal_end(tmp_path: Path):
    """--stop-at-step=--steps stops nowhere early: the run ends and writes metrics.json."""
    run_dir = tmp_path / "run"
    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), "--steps", "5", *SMALL, "--stop-at-step", "5")
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 5
