"""python -m tools.study --launcher slurm on the real one-node Slurm: one job array, every run finished,
study.json agreeing with the runs' metrics.json, and a second start that submits nothing.

2 learning rates x 2 seeds of a short toy run at 1 process, one CPU per task (two tasks side by side on the
2-CPU node), through docker/slurm-cpu.sbatch. About a minute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def command(runs: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tools.study",
        "toy",
        "--seeds",
        "2",
        "--grid",
        "lr=0.05,0.2",
        "--nproc",
        "1",
        "--launcher",
        "slurm",
        "--sbatch-script",
        "docker/slurm-cpu.sbatch",
        "--sbatch=--cpus-per-task=1",
        "--runs-dir",
        str(runs),
        "--",
        "--steps",
        "30",
        "--dataset-size",
        "256",
    ]


def test_study_as_one_job_array(slurm_cluster, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "SEED", "PYTHONPATH", "STUDY_TASKS")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    first = subprocess.run(command(tmp_path), cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert first.returncode == 0, first.stderr[-4000:]
    arrays = re.findall(r"job array (\d+), 4 task", first.stderr)
    assert len(arrays) == 1, first.stderr
    root = tmp_path / "studies" / "toy-lr"
    logs = sorted(path.name for path in (root / "logs").glob("slurm-*.out"))
    assert logs == [f"slurm-{arrays[0]}_{n}.out" for n in range(4)], logs
    data = json.loads((root / "study.json").read_text())
    assert {run["status"] for run in data["runs"]} == {"finished"}
    for run in data["runs"]:
        metrics = json.loads((root / run["run_dir"] / "metrics.json").read_text())
        assert run["metrics"]["final_loss"] == metrics["final_loss"]
        manifest = json.loads((root / run["run_dir"] / "manifest.json").read_text())
        assert manifest["seed"] == run["seed"] and manifest["config"]["lr"] == float(run["values"]["lr"])
    assert "95% CI" in first.stdout and "lr=0.2 - lr=0.05" in first.stdout
    again = subprocess.run(command(tmp_path), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing to run" in again.stderr and "job array" not in again.stderr
    assert again.stdout == first.stdout
