"""The toy's --stop-at-step (issue 14), as CIFAR10's: checkpoint and stop at that optimizer step, keeping the
schedule of --steps; no metrics.json, since the run has not ended; --resume continues it to the same weights.

The flags a contract checker drives (--run-dir, --seed, --resume, --stop-at-step) are common to every
training experiment; CIFAR10's are in tests/e2e/test_cifar10.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.e2e.launch import final_weights, run, torchrun

# 512 samples: 16 steps per epoch at a global batch of 32; stopping at 21 is mid-epoch and off the log interval.
SMALL = ("--dataset-size", "512", "--log-every", "10", "--batch-size", "16")
STEPS, STOP_AT = 40, 21


def toy(run_dir: Path, *extra: str) -> None:
    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), "--steps", str(STEPS), *SMALL, *extra)


def test_stop_at_step_then_resume_equals_an_uninterrupted_run(tmp_path: Path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    toy(reference)
    toy(interrupted, "--stop-at-step", str(STOP_AT))

    checkpoints = interrupted / "checkpoints"
    assert torch.load(checkpoints / "last.pt", weights_only=True)["step"] == STOP_AT
    assert (checkpoints / "last.pt").samefile(checkpoints / f"step_{STOP_AT:08d}.pt")
    assert not (interrupted / "metrics.json").exists()  # the run has not ended
    assert json.loads((interrupted / "manifest.json").read_text())["config"]["stop_at_step"] == STOP_AT

    toy(interrupted, "--resume")
    expected, got = final_weights(reference), final_weights(interrupted)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), f"{key} differs"
    metrics = json.loads((interrupted / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and not metrics["stopped_early"]


def test_stop_at_step_beyond_steps_is_one_line_exit_2(tmp_path: Path):
    result = run([sys.executable, "-m", "experiments.toy", "--run-dir", str(tmp_path / "run"), "--steps", "10", "--stop-at-step", "11"])
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
