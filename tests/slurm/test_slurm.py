"""docker/slurm-cpu.sbatch on a real one-node Slurm: a stop is a checkpoint, a requeue and a bitwise resume.

Two ways a job is stopped, each against the same uninterrupted run (torchrun --standalone, same flags):

- preemption: `scancel --signal=TERM --batch JOB` once the first checkpoint exists (the batch shell gets
  SIGTERM, as from the time-limit signal, and forwards it to the torchrun agent and its workers);
- the time limit: `--time=1 --signal=B:TERM@20`; Slurm checks every 30 s, so the signal comes 20 to 50 s
  before the minute is up. Every start of the job gets it again until the run is done.

Each time: the workers stop after the same step and write a checkpoint, the launcher exits 143, the batch
script runs `scontrol requeue`, the job starts again (SLURM_RESTART_COUNT >= 1) in the same run
directory (runs/toy/slurm-<job id>), which holds a checkpoint, so the script adds --resume; the run
finishes with metrics.json, and its final weights are bitwise those of the uninterrupted run.

The workers of the Slurm jobs sleep after each step (tests/slurm/slow_steps), so that a run outlasts the
time-limit signal on any machine; the sleep changes no number. Both jobs and the reference run side by
side (about 2.5 minutes in all).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.slurm.conftest import RESULTS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "slurm-cpu.sbatch"
SLOW_STEPS = Path(__file__).resolve().parent / "slow_steps"
FLAGS = ("--steps", "3000", "--dataset-size", "512", "--checkpoint-every", "200", "--log-every", "1000")
STEP_SLEEP_S = "0.015"  # 3000 steps: 45 s of sleep, more than the 40 s the time-limit signal may take to come
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "CANCELLED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
JOB_TIMEOUT_S = 600  # a time-limit job is typically requeued 2 to 4 times, each start at most 60 s


def _env(**extra: str) -> dict[str, str]:
    """This environment without what would steer the runs elsewhere; the GPUs hidden (tests/conftest.py)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name
        not in (
            "RUN_DIR",
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "PYTHONPATH",
            "STEP_SLEEP_S",
        )
    }
    return {**env, "CUDA_VISIBLE_DEVICES": "", **extra}


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 1.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)


class Reference:
    """The uninterrupted run, started at once in the background (the Slurm jobs mostly sleep meanwhile)."""

    def __init__(self, root: Path):
        self.run_dir = root / "reference"
        self.log = root / "reference.log"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "experiments.toy",
            *FLAGS,
            "--run-dir",
            str(self.run_dir),
        ]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        self._weights: dict[str, torch.Tensor] | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            code = self.process.wait(timeout=600)
            assert code == 0, f"the uninterrupted run exited {code}:\n{self.log.read_text()[-3000:]}"
            self._weights = torch.load(self.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
        return self._weights

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Iterator[Reference]:
    made = Reference(tmp_path_factory.mktemp("slurm-reference"))
    yield made
    made.stop()


class Job:
    """One sbatch of docker/slurm-cpu.sbatch, run in its own folder (the script's defaults: log, run dir)."""

    def __init__(self, workdir: Path, *sbatch_options: str):
        (workdir / ".venv").symlink_to(REPO / ".venv")  # the script runs .venv/bin/python from its folder
        env = _env(EXPERIMENT="toy", NPROC="2", PYTHONPATH=str(SLOW_STEPS), STEP_SLEEP_S=STEP_SLEEP_S)
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={workdir}", *sbatch_options, str(SCRIPT), *FLAGS],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
        self.id = submitted.stdout.strip().split(";")[0]
        self.log = workdir / f"ddp-lab-cpu-{self.id}.out"
        self.run_dir = workdir / "runs" / "toy" / f"slurm-{self.id}"
        self.started = time.monotonic()

    def info(self) -> dict[str, str]:
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", self.id], capture_output=True, text=True, timeout=30
        )
        assert shown.returncode == 0, shown.stderr
        return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)

    def state(self) -> str:
        return self.info()["JobState"]

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_final(self) -> dict[str, str]:
        info = wait_for(
            lambda: (i := self.info())["JobState"] in FINAL_STATES and i, JOB_TIMEOUT_S, f"job {self.id} to end", 2
        )
        assert isinstance(info, dict)
        return info

    def cancel(self) -> None:
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", self.id], capture_output=True, text=True, timeout=30
        )
        if shown.returncode == 0 and not any(f"JobState={state} " in shown.stdout for state in FINAL_STATES):
            subprocess.run(["scancel", self.id], timeout=30)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> Iterator[dict[str, Job]]:
    """Both jobs at once, one CPU each, so that they run side by side on a 2-CPU node (their workers mostly
    sleep); the time-limit one with the shortest limit Slurm has and a signal 20 s before it."""
    root = tmp_path_factory.mktemp("slurm-jobs")
    made: dict[str, Job] = {}
    try:
        for name, options in (("preempted", ()), ("time limit", ("--time=1", "--signal=B:TERM@20"))):
            workdir = root / name.replace(" ", "-")
            workdir.mkdir()
            made[name] = Job(workdir, "--cpus-per-task=1", *options)
        yield made
    finally:
        for job in made.values():  # only this module's own jobs
            job.cancel()


def check_requeued_resumed_bitwise(job: Job, info: dict[str, str], reference: Reference) -> tuple[list[int], list[int]]:
    """The job ended well after at least one stop: (steps it stopped after, steps it resumed at)."""
    log = job.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"{info['JobState']} {info['ExitCode']}\n{log[-4000:]}"
    )
    starts = [int(n) for n in re.findall(rf"slurm: job {job.id} start (\d+) ", log)]
    stopped = [int(n) for n in re.findall(r"\[rank 0/2\] WARNING stopped by a signal after step (\d+)", log)]
    resumed = [int(n) for n in re.findall(r"resumed \S+ at step (\d+)", log)]
    assert int(info["Restarts"]) >= 1 and len(starts) >= 2 and starts == list(range(len(starts))), (
        info["Restarts"],
        starts,
        log[-4000:],
    )
    assert int(info["Restarts"]) == len(starts) - 1
    assert log.count("requeued; its next start continues") == len(starts) - 1, log[-4000:]
    assert stopped and resumed, f"no stop with a checkpoint and resume in the log:\n{log[-4000:]}"
    assert set(resumed) <= set(stopped) | set(range(0, 3001, 200)), (
        stopped,
        resumed,
    )  # a stop's checkpoint, or a regular one
    assert resumed[0] > 0 and "--resume: it holds a checkpoint" in log
    assert (job.run_dir / "metrics.json").exists(), sorted(p.name for p in job.run_dir.iterdir())
    final = torch.load(job.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert final["step"] == 3000
    expected = reference.weights()
    assert final["model"].keys() == expected.keys()
    different = [name for name, tensor in expected.items() if not torch.equal(tensor, final["model"][name])]
    assert not different, f"not bitwise equal to the uninterrupted run: {different}"
    return stopped, resumed


def test_preempted_job_is_requeued_and_resumes_bitwise(jobs, reference):
    job = jobs["preempted"]
    wait_for(
        lambda: (job.run_dir / "checkpoints" / "last.pt").exists() or job.state() in FINAL_STATES,
        180,
        f"job {job.id}'s first checkpoint",
    )
    assert job.state() == "RUNNING", job.text()[-3000:]
    # What a preemption sends the batch shell, as --signal=B:TERM does before the time limit.
    subprocess.run(["scancel", "--signal=TERM", "--batch", job.id], check=True, timeout=30)
    info = job.wait_final()
    stopped, resumed = check_requeued_resumed_bitwise(job, info, reference)
    assert int(info["Restarts"]) == 1 and len(stopped) == 1 and resumed == stopped, (info["Restarts"], stopped, resumed)
    assert "got SIGTERM: forwarded to the run" in job.text()
    RESULTS["preempted"] = (
        f"preempted at step {stopped[0]} (scancel --signal=TERM --batch), requeued, resumed at step "
        f"{resumed[0]}: bitwise identical to the uninterrupted run ({time.monotonic() - job.started:.0f} s)"
    )


def test_job_at_its_time_limit_is_requeued_and_resumes_bitwise(jobs, reference):
    job = jobs["time limit"]
    info = job.wait_final()
    log = job.text()
    assert int(info["Restarts"]) >= 1, f"the run ended before Slurm's time-limit signal came:\n{log[-4000:]}"
    stopped, resumed = check_requeued_resumed_bitwise(job, info, reference)
    assert log.count("got SIGTERM: forwarded to the run") >= len(stopped), log[-4000:]
    assert "TIME LIMIT" not in log and "DUE TO TIME LIMIT" not in log, log[-4000:]  # stopped before Slurm's own kill
    RESULTS["time limit"] = (
        f"time limit (--time=1 --signal=B:TERM@20): stopped at step(s) {', '.join(map(str, stopped))}, "
        f"requeued {info['Restarts']} time(s), resumed: the same ({time.monotonic() - job.started:.0f} s)"
    )
