"""A hang on NCCL names each rank's Python line as on gloo (tests/e2e/test_hang_stacks.py): NCCL's watchdog dumps
the flight recorder and aborts the ranks whose collective timed out (their stacks come from faulthandler's fatal
handler); the launcher has the stuck rank dump its own. NCCL takes one GPU per rank: two GPUs at least.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from ddp_core.exit_codes import HUNG_EXIT_CODE
from tests.e2e.launch import run, torchrun_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_a_hang_on_nccl_names_the_stuck_rank_s_line_and_keeps_every_stack(tmp_path: Path):
    run_dir = tmp_path / "run"
    flags = ("--run-dir", str(run_dir), "--steps", "60", "--dataset-size", "256", "--backend", "nccl")
    command = torchrun_command(2, "tests.e2e.stuck_rank", *flags, launcher="ddp_core.torchrun", python=sys.executable)
    env = {"STUCK": "hook", "STUCK_RANK": "1", "STUCK_STEP": "5", "DIST_TIMEOUT_S": "20"}
    result = run(command, timeout=300, DIST_INIT_TIMEOUT_S="300", **env)
    output = result.stdout + result.stderr
    assert result.returncode == HUNG_EXIT_CODE, output[-5000:]
    lines = [line for line in output.splitlines() if line.startswith(("error: ", "rank ", "flight recorder: "))]
    assert re.match(r"error: rank \d( aborted after a flight-recorder dump|: a collective timed out)", lines[0]), lines
    assert any(re.fullmatch(r"rank 1: tests/e2e/stuck_rank\.py:\d+ sleep_in_the_hook .*", line) for line in lines)
    assert "each rank's stacks: " in lines[-1] and len(lines) <= 10, lines
    assert sorted(path.name for path in run_dir.glob("stacks_rank_*.txt")) == ["stacks_rank_0.txt", "stacks_rank_1.txt"]
