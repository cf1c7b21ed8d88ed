"""Bitwise resume at 3 and 4 processes: with 3 or more ranks the order of a sum matters.

Every way a run is interrupted and continued (--stop-at-step or fewer --steps then --resume; --resume-from the
uninterrupted run's own mid-epoch checkpoint into another run directory; a worker SIGKILLed under --max-restarts,
again after each restart; SIGTERM to one rank, then --resume) must end with the weights of the run that was never
interrupted, bit for bit, for the toy and for CIFAR10 with and without synchronized batch norm, with the checkpoint
in the middle of an epoch, under standalone and static rendezvous.
The 2-process cases are in test_toy.py, test_faults.py and test_cifar10.py. ``tools.contract``
(tests/e2e/test_contract.py) already checks --stop-at-step then --resume at 3 processes for the toy and
CIFAR10 with synchronized batch norm, and SIGTERM to torchrun at 3: the matrix here is what it does not
(4 processes, static rendezvous, no sync BN, torch.compile with accumulation, a killed worker, SIGTERM
to one rank), spread over five uninterrupted reference runs. torch.compile runs at 2 processes: what it adds is the
compiled graph (its state dict's prefix, a resume that compiles again, no_sync micro-steps), not an order of sums,
and each rank compiles the graph anew (inductor's C++ on CPU: about 20 s of CPU per rank with a cold cache).
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddp_core.exit_codes import STOPPED_EXIT_CODE
from ddp_core.layout import step_file_name
from ddp_core.process import timeline, warm
from ddp_core.process.launch import free_port
from tests import prefork
from tests.e2e.launch import final_weights, run

# Toy: 512 samples at 16 per process: 8 steps per epoch with 4 processes. Checkpoints every 7 steps put
# the last one before step 25 at step 21, in the middle of an epoch.
TOY = ("--dataset-size", "512", "--batch-size", "16", "--steps", "40", "--checkpoint-every", "7", "--log-every", "10")
# CIFAR10: 640 images at 32 per process: 6 steps per epoch with 3 processes, 5 with 4 (2 epochs).
# Checkpoints every 4 steps (and at each epoch's end) put the last one before step 9 at step 8, mid-epoch.
CIFAR = (
    "--model",
    "small",
    "--batch-size",
    "32",
    "--no-verify",
    "--log-every",
    "2",
    "--eval-batch-size",
    "64",
    "--epochs",
    "2",
    "--checkpoint-every",
    "4",
)
INTERRUPT_AT = {"toy": 25, "cifar10": 9}  # the step at which a worker is killed or signalled
# A worker killed in each attempt, at its N-th optimizer step counted from the attempt's start (a resume's
# settling step included): toy steps 25, 29 and 33 (back to the checkpoint of step 21, 28, 28); CIFAR10 9 and 10.
KILLED_AT = {"toy": (25, 9, 6), "cifar10": (9, 3)}
STOP_AT = {("toy", 4): 21, ("cifar10", 3): 8, ("cifar10", 4): 7}  # mid-epoch
COMPILED_ACCUMULATING = ("--compile", "--grad-accum", "2")  # 5 optimizer steps per epoch with 2 processes
# Its checkpoints: steps 4, 5 (an epoch's end), 8 and 10; the newest two are kept, and step 8 is mid-epoch.
COMPILED_RESUMED_FROM = 8


@dataclass(frozen=True)
class Job:
    experiment: str
    nproc: int
    sync_bn: bool = True
    rendezvous: str = "standalone"
    extra: tuple[str, ...] = ()

    @property
    def flags(self) -> tuple[str, ...]:
        if self.experiment == "toy":
            return TOY
        return CIFAR + (() if self.sync_bn else ("--no-sync-bn",)) + self.extra

    def torchrun_args(self) -> tuple[str, ...]:
        if self.rendezvous == "standalone":
            return ("--standalone",)
        return ("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}")

    def command(
        self, run_dir: Path, data_dir: Path, *extra: str, module: str | None = None, launcher_args: tuple[str, ...] = ()
    ) -> list[str]:
        """`python -m ddp_core.torchrun` (torchrun's exit codes, 143 for a stop) running ``module`` or the
        experiment."""
        data = ("--data-dir", str(data_dir)) if self.experiment == "cifar10" else ()
        target = (
            ("-m", module, f"experiments.{self.experiment}") if module else ("-m", f"experiments.{self.experiment}")
        )
        return [
            prefork.python(),
            "-m",
            "ddp_core.torchrun",
            *self.torchrun_args(),
            *launcher_args,
            f"--nproc-per-node={self.nproc}",
            *target,
            "--run-dir",
            str(run_dir),
            *data,
            *self.flags,
            *extra,
        ]

    def __str__(self) -> str:
        bn = "" if self.experiment == "toy" else ("-syncbn" if self.sync_bn else "-nosyncbn")
        return "-".join(
            [f"{self.experiment}-{self.nproc}{bn}", *(flag.strip("-") for flag in self.extra), self.rendezvous]
        )


def launch(job: Job, run_dir: Path, data_dir: Path, *extra: str, expect: int = 0, **kwargs) -> None:
    env = kwargs.pop("env", {})
    result = run(job.command(run_dir, data_dir, *extra, **kwargs), timeout=300, **env)
    assert result.returncode == expect, (
        f"{job} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """The uninterrupted run's directory, one run per (experiment, processes, batch norm, flags)."""
    cache: dict[tuple, Path] = {}

    def run_dir(job: Job) -> Path:
        key = (job.experiment, job.nproc, job.sync_bn, job.extra)
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp("reference") / str(job)
            launch(job, cache[key], data_dir)
        return cache[key]

    return run_dir


def differing(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    assert expected.keys() == actual.keys()
    return [key for key in expected if not torch.equal(expected[key], actual[key])]


def stop_then_resume(job: Job, run_dir: Path, data_dir: Path, module: str | None = None, **env: str) -> None:
    stop_at = STOP_AT[job.experiment, job.nproc]
    longer = ()
    if job.experiment == "toy":  # a shorter run, then continued to the full length: a change the user allows
        launch(job, run_dir, data_dir, "--steps", str(stop_at))
        longer = ("--allow-config-change",)
    else:
        launch(job, run_dir, data_dir, "--stop-at-step", str(stop_at))
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == stop_at
    launch(job, run_dir, data_dir, "--resume", *longer, module=module, env=env)


@pytest.mark.parametrize(
    "job",
    [
        Job("toy", 4, rendezvous="static"),
        Job("cifar10", 4, sync_bn=False, rendezvous="static"),
        Job("cifar10", 2, sync_bn=True, extra=COMPILED_ACCUMULATING),  # torch.compile and no_sync micro-steps
    ],
    ids=str,
)
def test_stop_and_resume_is_bitwise(tmp_path: Path, data_dir: Path, reference, job: Job):
    if job.extra == COMPILED_ACCUMULATING:  # compiling on every rank makes each launch long: two, not three
        mid_run = reference(job) / "checkpoints" / step_file_name(COMPILED_RESUMED_FROM)
        launch(job, tmp_path / "run", data_dir, "--resume-from", str(mid_run))
        metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
        assert metrics["checkpoints_saved"] == 1  # step 10's alone: it went on from step 8, not from the start
    else:
        stop_then_resume(job, tmp_path / "run", data_dir)
    weights = final_weights(tmp_path / "run")
    assert differing(final_weights(reference(job)), weights) == []
    assert not [key for key in weights if key.startswith(("module.", "_orig_mod."))]  # loads into the plain model


@pytest.mark.parametrize("job", [Job("toy", 3), Job("cifar10", 3, sync_bn=True)], ids=str)
def test_a_killed_worker_restarts_and_resumes_bitwise(tmp_path: Path, data_dir: Path, reference, job: Job):
    """The last rank SIGKILLed in a step, again in each restarted group (KILLED_AT), its checkpoints written in the
    background (the default): each restarted group resumes from the mid-epoch checkpoint before the kill and the
    run ends as if never hit."""
    kills = KILLED_AT[job.experiment]
    fault = {"FAULT": "sigkill", "FAULT_RANK": str(job.nproc - 1), "FAULT_STEP": ",".join(map(str, kills))}
    fault[timeline.VARIABLE] = str(tmp_path / "timeline")
    restarts = (f"--max-restarts={len(kills)}",)
    launch(job, tmp_path / "run", data_dir, module="tests.e2e.faulty", launcher_args=restarts, env=fault)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["world"]["restart_count"] == len(kills)  # every kill happened, each in its own attempt
    assert differing(final_weights(reference(job)), final_weights(tmp_path / "run")) == []
    # Every restarted worker forked from the job's one warm parent (ddp_core.process.warm), the first group cold;
    # the later kills hit forked workers, whose clients ended as they did.
    events = [event for event in timeline.read(tmp_path / "timeline") if event["event"] == "warm"]
    restarted = {(rank, restart) for rank in range(job.nproc) for restart in range(1, len(kills) + 1)}
    assert {(event["rank"], event["restart"]) for event in events} == restarted and len(events) == len(restarted)
    assert len({event["parent"] for event in events}) == 1


def test_a_forked_worker_killed_with_no_restart_left_is_one_report_with_its_code(tmp_path: Path, data_dir: Path):
    """The restarted group's rank 2 (forked from the warm parent) SIGKILLed, no restart left: the job ends as for
    a cold worker, one report naming the rank and the signal, exit 128 + 9; nothing left in the temp folder."""
    job = Job("toy", 3)
    (tmp_path / "tmp").mkdir()
    fault = {"FAULT": "sigkill", "FAULT_RANK": "2", "FAULT_STEP": "25,9", "TMPDIR": str(tmp_path / "tmp")}
    command = job.command(tmp_path / "run", data_dir, module="tests.e2e.faulty", launcher_args=("--max-restarts=1",))
    result = run(command, timeout=300, **fault)
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGKILL, output[-4000:]
    [report] = [line for line in output.splitlines() if line.startswith("error: ")]
    assert report.startswith("error: rank 2 (host ") and "killed by SIGKILL" in report, report
    assert "ChildFailedError" not in output and "Root Cause" not in output, output[-4000:]
    assert not [path for path in (tmp_path / "tmp").iterdir() if path.name.startswith(("torchelastic_", "ddp-lab-"))]


def test_fast_restart_off_restarts_cold(tmp_path: Path, data_dir: Path, reference):
    """``DDP_LAB_FAST_RESTART=0``: the restarted workers are new interpreters, and the run ends as if never hit."""
    job = Job("toy", 3)
    fault = {"FAULT": "sigkill", "FAULT_RANK": "1", "FAULT_STEP": "25", warm.VARIABLE: "0"}
    fault[timeline.VARIABLE] = str(tmp_path / "timeline")
    launch(job, tmp_path / "run", data_dir, module="tests.e2e.faulty", launcher_args=("--max-restarts=1",), env=fault)
    assert differing(final_weights(reference(job)), final_weights(tmp_path / "run")) == []
    events = timeline.read(tmp_path / "timeline")
    assert [event["restart"] for event in events if event["event"] == "spawned"] == [0, 1]
    assert not [event for event in events if event["event"] == "warm"]


@pytest.mark.parametrize("job", [Job("toy", 4), Job("cifar10", 3, sync_bn=True, rendezvous="static")], ids=str)
def test_a_stop_signal_then_resume_is_bitwise(tmp_path: Path, data_dir: Path, reference, job: Job):
    """SIGTERM to the last rank in a step: every rank stops after that step (on CPU), exit 143; --resume."""
    step = INTERRUPT_AT[job.experiment]
    fault = {"FAULT": "sigterm", "FAULT_RANK": str(job.nproc - 1), "FAULT_STEP": str(step)}
    launch(job, tmp_path / "run", data_dir, module="tests.e2e.faulty", env=fault, expect=STOPPED_EXIT_CODE)
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == step
    launch(job, tmp_path / "run", data_dir, "--resume")
    assert differing(final_weights(reference(job)), final_weights(tmp_path / "run")) == []


def test_the_check_notices_a_resume_that_keeps_the_first_bucket_layout(tmp_path: Path, data_dir: Path, reference):
    """Negative control: without settling DDP's buckets, a 3-process CIFAR10 resume ends elsewhere."""
    job = Job("cifar10", 3, sync_bn=True)
    stop_then_resume(job, tmp_path / "run", data_dir, module="tests.e2e.broken_resume", BROKEN_RESUME="bucket_layout")
    assert differing(final_weights(reference(job)), final_weights(tmp_path / "run")) != []
