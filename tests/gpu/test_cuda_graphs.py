"""CIFAR10's --cuda-graphs on a GPU, selected with `pytest -m gpu` (make gpu-check): the non-finite guard still
stops a run whose compiled step is replayed as CUDA graphs (exit 3) at the step whose loss is not finite.
(Stopped and resumed, it ends bitwise: tests/gpu/test_steady_state_gpu.py, in every mode.)

Skipped without CUDA ("needs CUDA"); tests/unit/test_cifar10_speed.py checks on CPU how the flag reaches
torch.compile and that it is refused without CUDA.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ddp_core.exit_codes import DIVERGED_EXIT_CODE
from tests.e2e.launch import run, torchrun_command
from tests.gpu.test_amp_sync_bn import FAST, data_dir  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GRAPHS = ("--cuda-graphs", "--deterministic", "--checkpoint-every", "4")


def test_the_guard_stops_a_graphed_run_at_a_non_finite_loss(tmp_path, data_dir):  # noqa: F811
    """NaN in the 7th loss: the guard's check at the log step 8 stops the run before step 8's checkpoint."""
    command = torchrun_command(
        1,
        "tests.e2e.faulty",
        "experiments.cifar10",
        "--run-dir",
        str(tmp_path / "run"),
        "--data-dir",
        str(data_dir),
        *FAST,
        *GRAPHS,
        python=sys.executable,
        launcher="ddp_core.torchrun",
    )  # plain torchrun exits 1 for every failed worker
    result = run(command, timeout=600, FAULT="nan_loss", FAULT_RANK="0", FAULT_STEP="7")
    assert result.returncode == DIVERGED_EXIT_CODE, result.stderr[-3000:]
    assert "became nan at step 7 (rank 0)" in result.stderr and "stopped at step 8" in result.stderr
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 4
