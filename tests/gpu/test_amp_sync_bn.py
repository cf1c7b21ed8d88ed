"""CIFAR10's GPU-only paths, selected with `pytest -m gpu` (make gpu-check): autocast as `auto`
picks it on this GPU, fp16 with a GradScaler forced, and GlobalBatchNorm under nccl on 2+ GPUs.

Skipped without CUDA ("needs CUDA"); the CPU equivalents run in tests/e2e/test_cifar10_amp.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.launch import final_weights, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAST = (
    "--model",
    "small",
    "--batch-size",
    "64",
    "--no-verify",
    "--log-every",
    "2",
    "--epochs",
    "2",
    "--backend",
    "nccl",
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from experiments.cifar10_data import make_learnable_images, write_cifar10_format

    root = tmp_path_factory.mktemp("cifar")
    train, test = make_learnable_images(1280, seed=0), make_learnable_images(301, seed=1)
    write_cifar10_format(root, train.images, train.labels, test.images, test.labels)
    return root


def cifar10(nproc: int, run_dir: Path, data_dir: Path, *extra: str) -> dict:
    torchrun(
        nproc,
        "experiments.cifar10",
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data_dir),
        *FAST,
        *extra,
        timeout=600,
        python=sys.executable,
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["eval_accuracy"] > 0.5 and math.isfinite(metrics["eval_loss"]), metrics
    assert {v.dtype for v in final_weights(run_dir).values() if v.is_floating_point()} == {torch.float32}
    return metrics


def test_amp_auto_picks_bf16_where_native_else_fp16_with_a_scaler(tmp_path, data_dir):
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert cifar10(1, tmp_path / "run", data_dir)["amp"] == ("bf16" if native else "fp16 + GradScaler")


def test_fp16_with_a_grad_scaler_learns_and_checkpoints_the_scale(tmp_path, data_dir):
    assert cifar10(1, tmp_path / "run", data_dir, "--amp-dtype", "fp16")["amp"] == "fp16 + GradScaler"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["grad_scaler"]["scale"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: batch norm is synchronized across processes")
@pytest.mark.parametrize("impl", ["global", "torch"])
def test_synchronized_batchnorm_on_every_gpu(tmp_path, data_dir, impl):
    cifar10(torch.cuda.device_count(), tmp_path / "run", data_dir, "--sync-bn-impl", impl)
