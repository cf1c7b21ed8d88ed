"""bench.recovery --heal end to end, tiny (the toy at 2 processes, one fault): its report, not its figures. Two
processes: one survivor, which cannot disagree with another on whether a pause failed (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from bench.recovery_heal import PHASES
from tests.e2e.launch import REPO, clean_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="--heal needs torchft: pip install -r requirements-heal.txt"
)


def test_under_heal_each_fault_is_timed_from_the_kill_and_bitwise_and_the_survivors_processes_are_reported():
    command = [sys.executable, "-m", "bench.recovery", "--heal", "--experiments", "toy", "--nproc", "2"]
    command += ["--every", "1", "--faults", "1", "--toy-steps", "300", "--repeats", "1", "--timeout", "120", "--json"]
    done = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.stdout.startswith("{"), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["args"]["heal"] is True
    [row] = report["results"]["toy"]
    [fault] = row["faults"]
    # the replacement's every event came after the kill; the survivor's detection only where it had a step to abandon
    # (a kill between a commit and the next step's quorum leaves it waiting there, nothing to retry)
    assert {name for name, _ in PHASES} - {"detection"} <= set(fault["phases"]), fault
    assert ("detection" in fault["phases"]) == (fault["abandoned"] > 0), fault
    assert fault["lost_s"] == fault["phases"]["first step"]
    assert row["survivors_kept"] is True  # the survivor's process trained to the end
    assert row["bitwise"] is True  # the faulted run's weights are the fault-free --heal run's
    assert row["pace_without_heal"] > 0 and row["heal_pace_ratio"] > 0
    assert done.returncode == 0, done.stderr[-3000:]
