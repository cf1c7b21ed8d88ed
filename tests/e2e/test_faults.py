"""Faults that must not hurt what is already running or written (issue 5, first slice)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddp_core.launch import free_port
from tests.e2e.launch import REPO, clean_env, final_weights, torchrun, torchrun_command


def workers_of(agent_pid: int) -> list[int]:
    """The agent's child processes that run the experiment (torchrun's workers)."""
    children = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in children if b"experiments.toy" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.parametrize("rendezvous", ["standalone", "static"])
def test_a_killed_worker_is_restarted_and_the_run_resumes_bitwise(tmp_path: Path, rendezvous: str):
    """SIGKILL one worker mid-run under --max-restarts=1: torchrun restarts the group, the restarted
    workers find this job's run directory and its last checkpoint, and the run ends as if never hit."""
    flags = ("--steps", "3000", "--dataset-size", "512", "--checkpoint-every", "100", "--log-every", "1000")
    reference = tmp_path / "reference"
    torchrun(2, "experiments.toy", "--run-dir", str(reference), *flags)

    work = tmp_path / "work"  # no --run-dir: the default runs/toy/<timestamp>, under this folder
    work.mkdir()
    torchrun_args = ("--standalone",) if rendezvous == "standalone" else ("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}")
    agent = subprocess.Popen(
        torchrun_command(2, "experiments.toy", *flags, torchrun_args=(*torchrun_args, "--max-restarts=1")),
        cwd=work, env=clean_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(work.glob("runs/toy/*/checkpoints/last.pt")) and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for a condition: the first checkpoint
        victims = workers_of(agent.pid)
        assert agent.poll() is None and len(victims) == 2, "the run ended (or never started) before the kill"
        os.kill(victims[1], signal.SIGKILL)
        output = agent.communicate(timeout=300)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]
    [run_dir] = list(work.glob("runs/toy/*"))  # the restart continued the same run directory
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["resumed"] is True and manifest["world"]["restart_count"] == 1 and len(manifest["history"]) == 1
    expected, resumed = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)
