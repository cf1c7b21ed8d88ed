"""Faults that must not hurt what is already running or written (issue 5, first slice)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ddp_core.launch import free_port
from tests.e2e.launch import REPO, clean_env, run, torchrun_command


def test_a_second_job_on_a_busy_port_fails_naming_the_port_and_the_first_finishes(tmp_path: Path):
    port = free_port()
    first_dir = tmp_path / "first"
    first = subprocess.Popen(
        torchrun_command(2, "experiments.toy", "--run-dir", str(first_dir), "--steps", "3000", "--dataset-size", "512", "--log-every", "1000",
                         torchrun_args=("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}")),
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (first_dir / "manifest.json").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # waiting for a condition (the first job is training), not for a fixed time
        assert first.poll() is None, "the first job ended before the second started: make it longer"
        second = run([sys.executable, "-m", "experiments.toy", "--run-dir", str(tmp_path / "second")], timeout=120,
                     RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DIST_TIMEOUT_S="30")
        assert second.returncode != 0
        assert f"port {port} on 127.0.0.1 is already in use" in second.stderr, second.stderr[-2000:]
        assert not (tmp_path / "second").exists()
        output = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, output[-3000:]
    assert json.loads((first_dir / "metrics.json").read_text())["steps"] == 3000
