"""python -m tools.study end to end: the toy, 2 learning rates x 3 seeds, 2 runs at a time (--parallel 2),
killed mid-way and started again.

The first start runs its workers with a short sleep after each step (tests/slurm/slow_steps: no number
changes) so that the third run can be caught between its first checkpoint and its end; the study, its
launchers and workers are then SIGKILLed. The same command again skips the finished runs, resumes
the killed ones from their checkpoints and runs the others; a third start runs nothing and prints the same
table. study.json's numbers are the runs' own metrics.json values. The same grid for seed 0, run one after
another, ends with the same weights bit for bit. A changed grid or a flag that changes the computation is
refused in one line, exit 2, before anything runs. About 9 toy runs at 1 process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.study_kill import running
from ddp_core.runs import read_run
from tests import prefork
from tests.e2e.launch import final_weights

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
SLOW_STEPS = REPO / "tests" / "slurm" / "slow_steps"
FLAGS = ["--steps", "30", "--dataset-size", "256", "--checkpoint-every", "5", "--log-every", "10"]


def study_command(
    runs: Path, *extra: str, flags: list[str] = FLAGS, python: str | None = None, seeds: int = 3, parallel: int = 2
) -> list[str]:
    """``python``: the real interpreter by default, or tests.prefork's stand-in (the study's runs then fork from the
    suite's server too: they start with its sys.executable)."""
    return [
        python or sys.executable,
        "-m",
        "tools.study",
        "toy",
        "--seeds",
        str(seeds),
        "--grid",
        "lr=0.05,0.2",
        "--nproc",
        "1",
        "--runs-dir",
        str(runs),
        "--parallel",
        str(parallel),
        *extra,
        "--",
        *flags,
    ]


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "SEED", "STEP_SLEEP_S", "PYTHONPATH")}
    return {**base, "CUDA_VISIBLE_DEVICES": "", **extra}


def wait_for(condition, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the study ended (exit {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.02)  # polling a file; the condition, not the sleep, decides


def kill_everything(study: subprocess.Popen) -> None:
    """SIGKILL the study and every run it started, as a machine that goes down would, and wait for the study's end.

    The study's own process is frozen first, so that it starts no run while its runs are read. Forked from the
    suite's server (tests/prefork.py), each run is its shim, whose SIGKILL kills the run's launcher; the launcher's
    workers die with it (ddp_core.process.orphans)."""
    process = prefork.stands_for(study.pid)  # the study's pid itself where it is a real interpreter
    os.kill(process, signal.SIGSTOP)
    runs = subprocess.run(["pgrep", "-P", str(process)], capture_output=True, text=True).stdout.split()
    for pid in (process, *map(int, runs)):
        os.kill(pid, signal.SIGKILL)
    study.kill()
    study.wait()


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> dict:
    runs = tmp_path_factory.mktemp("study-runs")
    root = runs / "studies" / "toy-lr"
    killed = root / "lr=0.05" / "seed-2"
    first = subprocess.Popen(
        study_command(runs, python=prefork.python()),
        cwd=REPO,
        env=env(PYTHONPATH=str(SLOW_STEPS), STEP_SLEEP_S="0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: (killed / "checkpoints" / "step_00000005.pt").exists(), first, 600, "the 3rd run's checkpoint")
    finally:
        kill_everything(first)

    # The killed study's runs die milliseconds apart, and a run reads "running" until its process is gone: a start
    # made between would be refused, rightly. So wait for every run, not only the one watched (bench.study_kill).
    deadline = time.monotonic() + 60
    while running(root) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the runs' state; the condition, not the sleep, decides
    assert not running(root), f"still running 60 s after the study was killed: {running(root)}"
    at_kill = {path: read_run(path, path.name) for path in sorted(root.glob("*/seed-*"))}
    again = study_command(runs, python=prefork.python())
    second = subprocess.run(again, cwd=REPO, env=env(), capture_output=True, text=True, timeout=800)
    third = subprocess.run(again, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    # seed 0 of both settings again, one run after the other
    serial = study_command(runs, "--name", "serial", python=prefork.python(), seeds=1, parallel=1)
    reference = subprocess.run(serial, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    return {
        "root": root,
        "killed": killed,
        "at_kill": at_kill,
        "second": second,
        "third": third,
        "runs": runs,
        "serial": reference,
    }


def launches_expected(study: dict, path: Path) -> int:
    """Once, unless the kill caught it mid-run (a manifest, no metrics): then twice."""
    info = study["at_kill"].get(path)
    return 2 if info is not None and info.manifest and info.status != "finished" else 1


def test_killed_study_resumes_stopped_runs_and_skips_finished(study):
    root, killed, at_kill = study["root"], study["killed"], study["at_kill"]
    finished = [path for path, info in at_kill.items() if info.status == "finished"]
    # the third run started once one of the first two (side by side) had finished
    assert finished and set(finished) <= {root / "lr=0.05" / "seed-0", root / "lr=0.05" / "seed-1"}, at_kill
    assert not at_kill[killed].metrics and at_kill[killed].status == "failed"  # SIGKILLed: no exit code, no metrics
    second = study["second"]
    assert second.returncode == 0, second.stdout + second.stderr[-3000:]
    assert second.stderr.count(": finished (exit 0") == 6 - len(finished), second.stderr  # all but the finished
    for path in root.glob("*/seed-*"):
        info = read_run(path, path.name)
        assert info.status == "finished" and info.step == 30
        assert info.launches == launches_expected(study, path), (path, info.launches)  # finished: not relaunched
    log = (root / "logs" / "lr=0.05.seed-2.log").read_text()
    resumed = [int(step) for step in re.findall(r"resumed \S+ at step (\d+)", log)]
    assert len(resumed) == 1 and resumed[0] in (5, 10, 15, 20, 25), log[-2000:]


def test_table_json_png_and_hparams(study):
    root, out = study["root"], study["second"].stdout
    assert "95% CI" in out and "paired difference" in out and "lr=0.2 - lr=0.05" in out
    assert any(word in out for word in ("better than", "worse than", "not distinguishable")), out
    data = json.loads((root / "study.json").read_text())
    assert [c["name"] for c in data["combinations"]] == ["lr=0.05", "lr=0.2"]
    for run in data["runs"]:
        metrics = json.loads((root / run["run_dir"] / "metrics.json").read_text())
        assert run["metrics"]["final_loss"] == metrics["final_loss"]
    for combo in data["combinations"]:
        loss = combo["metrics"]["final_loss"]
        values = [
            json.loads((root / combo["name"] / f"seed-{s}" / "metrics.json").read_text())["final_loss"]
            for s in range(3)
        ]
        assert loss["n"] == 3 and loss["mean"] == pytest.approx(sum(values) / 3)
        assert [loss["per_seed"][str(s)] for s in range(3)] == values
        assert loss["ci95"][0] <= loss["mean"] <= loss["ci95"][1]
    pair = next(c for c in data["comparisons"] if c["metric"] == "final_loss")
    assert pair["seeds"] == [0, 1, 2] and pair["verdict"] and pair["ci95"]
    assert (root / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for path in root.glob("*/seed-*"):
        assert len(list(path.glob("*.study-hparams"))) == 1, path


def test_the_default_outcome_is_the_toys_headline_metric_never_a_throughput(study):
    data = json.loads((study["root"] / "study.json").read_text())
    assert {c["metric"] for c in data["comparisons"]} == {"final_loss"}  # no samples_per_s: not asked for
    assert all(set(combo["metrics"]) == {"final_loss"} for combo in data["combinations"])


def test_started_again_it_runs_nothing(study):
    third, root = study["third"], study["root"]
    assert third.returncode == 0, third.stderr[-3000:]
    assert "nothing to run" in third.stderr
    assert third.stdout == study["second"].stdout
    for path in root.glob("*/seed-*"):
        assert read_run(path, path.name).launches == launches_expected(study, path)
        assert len(list(path.glob("*.study-hparams"))) == 1


def test_runs_side_by_side_end_with_the_weights_of_runs_one_after_another(study):
    """Parallelism is no part of a run: the serial study's runs (seed 0) equal the parallel study's bit for bit,
    whether that run finished in the killed start, was resumed, or ran in the second."""
    assert study["serial"].returncode == 0, study["serial"].stderr[-3000:]
    serial = study["runs"] / "studies" / "serial"
    for setting in ("lr=0.05", "lr=0.2"):
        ours, theirs = final_weights(study["root"] / setting / "seed-0"), final_weights(serial / setting / "seed-0")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), setting


@pytest.mark.parametrize(
    ("extra", "flags", "says"),
    [
        (("--grid", "batch-size=16,32", "--name", "toy-lr"), FLAGS, "was started with --grid lr=0.05,0.2"),
        ((), ["--steps", "40", *FLAGS[2:]], "--steps: 30 -> 40"),
    ],
    ids=["grid", "computation flag"],
)
def test_changed_study_is_refused_in_one_line(study, extra, flags, says):
    refused = subprocess.run(
        study_command(study["runs"], *extra, flags=flags, python=prefork.python()),
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2, refused.stderr
    assert says in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
