"""The toy's --stop-at-step, as CIFAR10's: checkpoint and stop at that optimizer step, keeping the
schedule of --steps. That the stop writes no metrics.json and that --resume then ends bitwise-equal to the
uninterrupted run, at 2 and 3 processes, is the contract's `resume` property (tests/e2e/test_contract.py);
here the stop line's command, run as printed, continues a run launched with other flags than the defaults.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from tests import prefork
from tests.e2e.launch import final_weights, run, torchrun

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


FIRST = ("--steps", "120", "--lr", "0.1", *SMALL)  # flags away from the toy's defaults, typed once


def files_of(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a run: its bytes and modification time."""
    return {
        str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def continued(tmp_path_factory) -> dict[str, Path]:
    """A run of 2 processes (--nproc 2) stopped at step 50 and continued by the command its stop line prints, as
    printed; and the same run uninterrupted."""
    base = tmp_path_factory.mktemp("continued")
    toy = [prefork.python(), "-m", "experiments.toy", "--nproc", "2"]
    whole = run([*toy, "--run-dir", str(base / "whole"), *FIRST])
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = run([*toy, "--run-dir", str(base / "run"), *FIRST, "--stop-at-step", "50"])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    said = [line for line in stopped.stdout.splitlines() if "to continue: " in line]
    assert len(said) == 1, stopped.stdout[-3000:]
    command = shlex.split(said[0].split("to continue: ")[1])
    assert command[:3] == ["python", "-m", "experiments.toy"] and command[3:] == [
        "--resume",
        "--run-dir",
        str(base / "run"),
    ]
    resumed = run([prefork.python(), *command[1:]])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"whole": base / "whole", "run": base / "run"}


def test_the_printed_command_alone_continues_the_run_bitwise(continued):
    weights, expected = final_weights(continued["run"]), final_weights(continued["whole"])
    assert [key for key in expected if not torch.equal(expected[key], weights[key])] == []
    manifest = json.loads((continued["run"] / "manifest.json").read_text())
    config = manifest["config"]  # the checkpoint's options, --nproc 2 with them
    assert (config["steps"], config["lr"], config["nproc"], manifest["config_changes"]) == (120, 0.1, 2, [])
    assert json.loads((continued["run"] / "metrics.json").read_text())["steps"] == 120


def test_a_finished_run_resumed_says_so_and_keeps_every_file(continued):
    before = files_of(continued["run"])
    result = run([prefork.python(), "-m", "experiments.toy", "--resume", "--run-dir", str(continued["run"])])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [line for line in result.stdout.splitlines() if "has finished" in line]
    assert len(result.stdout.splitlines()) == 1 and result.stderr == ""
    assert files_of(continued["run"]) == before  # metrics.json, manifest.json, TensorBoard: byte for byte


def test_a_finished_run_resumed_with_a_change_that_does_not_lengthen_it_keeps_every_file(continued):
    """--allow-config-change with another --lr but the same --steps: no step is left, so nothing is written."""
    before = files_of(continued["run"])
    command = ["--resume", "--run-dir", str(continued["run"]), "--allow-config-change", "--lr", "0.3"]
    result = run([prefork.python(), "-m", "experiments.toy", *command])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()  # the log's line that the checkpoint was read, then the verdict, once
    assert sum("has finished" in line for line in lines) == 1 and "has finished" in lines[-1], result.stdout
    assert "Traceback" not in result.stderr and "this run continues" not in result.stdout + result.stderr
    assert files_of(continued["run"]) == before  # metrics.json, manifest.json, code/, TensorBoard: byte for byte


@pytest.mark.parametrize(
    ("changed", "env", "words"),
    [
        (("--lr", "0.3", "--steps", "120"), {}, "--resume: --lr: 0.1 -> 0.3 (checkpoint"),
        ((), {"SEED": "4"}, "SEED: 0 -> 4"),
    ],
    ids=["flag", "variable"],
)
def test_an_option_set_on_resume_that_changes_the_run_is_refused_naming_it(continued, changed, env, words):
    before = files_of(continued["run"])
    command = [prefork.python(), "-m", "experiments.toy", "--resume", "--run-dir", str(continued["run"]), *changed]
    result = run(command, **env)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and words in lines[0] and "--steps" not in lines[0], result.stderr  # the same value is none
    assert files_of(continued["run"]) == before
