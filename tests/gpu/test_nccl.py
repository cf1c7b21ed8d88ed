"""nccl end to end on this machine's GPUs: selected with `pytest -m gpu` (make gpu-check).

Skipped without CUDA ("needs CUDA"), so `make test` on a CPU machine lists them as skipped, never passed.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.e2e.launch import final_weights, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_toy_on_one_gpu_with_nccl_ends_with_a_finite_loss_and_a_weights_only_checkpoint(tmp_path):
    run_dir = tmp_path / "toy"
    torchrun(
        1, "experiments.toy", "--steps", "50", "--backend", "nccl", "--run-dir", str(run_dir), python=sys.executable
    )
    loss = json.loads((run_dir / "metrics.json").read_text())["final_loss"]
    assert math.isfinite(loss)
    weights = final_weights(run_dir)  # torch.load(..., weights_only=True)
    assert set(weights) == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"}
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_nccl_all_reduce_and_all_gather_over_every_gpu():
    result = torchrun(torch.cuda.device_count(), "tests.gpu.nccl_worker", timeout=300, python=sys.executable)
    assert "all_reduce and all_gather ok" in result.stdout
