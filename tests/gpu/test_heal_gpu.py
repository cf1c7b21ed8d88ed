"""``--heal`` on NCCL (torchft's ProcessGroupNCCL for the gradients, torch's NCCL default group for the run's own
collectives): selected with ``pytest -m gpu``, skipped without the GPUs each test needs.

A replacement heals from a live peer, and NCCL refuses two ranks on one device ("Duplicate GPU detected"; torchft's
ProcessGroupNCCL is torch's, one communicator over every replica), so one worker's replacement needs two GPUs: one per
rank, cuda:LOCAL_RANK, the replacement on its dead worker's. One GPU runs a world of one: every step's quorum, commit
and group on NCCL, with no peer to heal from (a replacement there starts the run over: nothing to test).

Within one node NCCL does not see a peer die: the survivor's all-reduce ends at torchft's timeout (--dist-timeout-s),
so the kill costs that long; kept short here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import timeline as worker_timeline
from tests.e2e.heal_timeline import check_replaced_alone, training_pid
from tests.e2e.launch import REPO, clean_env, final_weights, torchrun_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="--heal needs torchft"),
]

HEAL = ("--standalone", "--heal", "--max-restarts=1")
# The kill lands in a step, early: the first pause (a log point, a checkpoint) is at step 500. A death in a pause's
# collective, on torch's NCCL group, is seen by NCCL's watchdog only, which by default ends the survivor too (by review:
# not measured). --deterministic: the retried step, the healed replacement and the run never hit compute the same bits.
TOY = ("--steps", "1000", "--dataset-size", "512", "--checkpoint-every", "500", "--log-every", "500")
NCCL = ("--backend", "nccl", "--deterministic", "--dist-timeout-s", "30")
VICTIM = 1


def heal_command(nproc: int, run_dir: Path) -> list[str]:
    args = (*TOY, *NCCL, "--run-dir", str(run_dir))
    return torchrun_command(
        nproc, "experiments.toy", *args, torchrun_args=HEAL, launcher="ddp_core.torchrun", python=sys.executable
    )


def start(nproc: int, folder: Path) -> tuple[subprocess.Popen, Path]:
    """The job, each worker noting its phases (``first_step`` with its pid and rank) in ``folder``'s timeline."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "timeline"
    env = clean_env(DIST_INIT_TIMEOUT_S="300", **worker_timeline.env(str(path)))
    command = heal_command(nproc, folder / "run")
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ), path


def finish(job: subprocess.Popen, timeout: float = 300) -> str:
    try:
        return job.communicate(timeout=timeout)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_heal_on_one_gpu_trains_to_the_end_on_nccl(tmp_path: Path):
    job, _ = start(1, tmp_path)
    output = finish(job)
    assert job.returncode == 0, output[-5000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 1000 and math.isfinite(metrics["final_loss"]), metrics


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL takes one GPU per rank")
def test_a_worker_killed_on_nccl_is_replaced_alone_and_the_run_ends_bitwise(tmp_path: Path):
    reference, _ = start(2, tmp_path / "fault-free")
    output = finish(reference)
    assert reference.returncode == 0, output[-5000:]
    run_dir = tmp_path / "healed" / "run"
    job, path = start(2, tmp_path / "healed")
    try:
        deadline = time.monotonic() + 300
        while training_pid(path, VICTIM) is None:
            assert job.poll() is None and time.monotonic() < deadline, "the run ended (or never started) first"
            time.sleep(0.05)  # polling a condition, not waiting for a guessed time
        before = {rank: training_pid(path, rank) for rank in range(2)}
        os.kill(before[VICTIM], signal.SIGKILL)  # the worker, not its client (ddp_core.process.warm): it replaces it
        output = finish(job)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-5000:]
    check_replaced_alone(path, VICTIM, before)
    expected, actual = final_weights(tmp_path / "fault-free" / "run"), final_weights(run_dir)
    assert [key for key in expected if not torch.equal(expected[key], actual[key])] == []
