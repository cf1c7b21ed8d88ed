"""CIFAR10 with autocast on CPU, launched by torchrun on the synthetic dataset: bf16 (what --amp picks on
a CPU and on a GPU with native bf16) and fp16 with a GradScaler (what a T4 or V100 gets), whose first
steps overflow for real (tests/e2e/amp_overflow.py raises the initial loss scale). The fp16 runs train a
network without convolutions: CPU has no fast float16 convolution backward (amp_overflow.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.e2e.launch import final_weights, torchrun
from tests.e2e.test_cifar10 import FAST

BF16 = ("--amp",)
FP16 = ("--amp", "--amp-dtype", "fp16")
FP16_INIT_SCALE = 2.0**19  # float16 gradients of the small CNN overflow above about 2**17 here: a few skipped steps


def cifar10(nproc: int, run_dir: Path, data_dir: Path, *extra: str) -> Path:
    wrapper = ("tests.e2e.amp_overflow",) if "fp16" in extra else ()
    torchrun(
        nproc,
        *wrapper,
        "experiments.cifar10",
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data_dir),
        *FAST,
        *extra,
        timeout=300,
        AMP_INIT_SCALE=str(FP16_INIT_SCALE),
        AMP_CONV_FREE="1",
    )
    return run_dir


def checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def assert_bitwise_equal(expected: Path, resumed: Path) -> None:
    want, got = final_weights(expected), final_weights(resumed)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


# 2 processes x batch 32: 10 steps per epoch; 3 processes: 6.
@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, data_dir) -> Path:
    return cifar10(2, tmp_path_factory.mktemp("amp") / "bf16", data_dir, "--epochs", "1", *BF16)


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory, data_dir) -> Path:
    return cifar10(3, tmp_path_factory.mktemp("amp") / "fp16", data_dir, "--epochs", "2", *FP16)


def assert_learned_with_float32_checkpoints(run_dir: Path, amp: str) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["amp"] == amp
    assert metrics["eval_accuracy"] > 0.5 and math.isfinite(metrics["eval_loss"])  # chance is 0.1
    weights = checkpoint(run_dir)["model"]
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {
        torch.float32
    }  # autocast casts activations only
    return metrics


def test_bf16_autocast_learns_and_checkpoints_float32_weights(bf16_run: Path):
    assert_learned_with_float32_checkpoints(bf16_run, "bf16")
    assert checkpoint(bf16_run)["grad_scaler"] is None  # bf16 needs no loss scaling


def test_bf16_resume_mid_epoch_equals_the_uninterrupted_run(tmp_path: Path, data_dir: Path, bf16_run: Path):
    interrupted = cifar10(2, tmp_path / "run", data_dir, "--epochs", "1", "--stop-at-step", "6", *BF16)
    cifar10(2, interrupted, data_dir, "--epochs", "1", "--resume", *BF16)
    assert_bitwise_equal(bf16_run, interrupted)


def test_fp16_overflowing_steps_are_skipped_without_stopping_the_run(fp16_run: Path):
    """The run exited 0: the guard, which watches the loss (finite on a skipped step), did not fire."""
    assert_learned_with_float32_checkpoints(fp16_run, "fp16 + GradScaler")
    assert checkpoint(fp16_run)["grad_scaler"]["scale"] < FP16_INIT_SCALE  # the scaler backed off: steps were skipped


@pytest.fixture(scope="module")
def fp16_stopped(tmp_path_factory, data_dir) -> Path:
    """The fp16 run stopped at step 7, after its skipped steps; each test continues a copy."""
    run_dir = cifar10(
        3, tmp_path_factory.mktemp("amp") / "fp16-stopped", data_dir, "--epochs", "2", "--stop-at-step", "7", *FP16
    )
    assert checkpoint(run_dir)["grad_scaler"]["scale"] < FP16_INIT_SCALE
    return run_dir


def test_fp16_resume_restores_the_loss_scale_and_equals_the_uninterrupted_run(
    tmp_path: Path, data_dir: Path, fp16_run: Path, fp16_stopped: Path
):
    interrupted = Path(shutil.copytree(fp16_stopped, tmp_path / "run"))
    cifar10(3, interrupted, data_dir, "--epochs", "2", "--resume", *FP16)
    assert_bitwise_equal(fp16_run, interrupted)
    resumed, uninterrupted = checkpoint(interrupted), checkpoint(fp16_run)
    assert resumed["config"]["resume"] and not uninterrupted["config"]["resume"]  # the launch's own flags
    for name in ("grad_scaler", "metrics", "experiment"):  # the loss scale and its growth tracker, the last loss
        assert resumed[name] == uninterrupted[name], name


def test_the_fp16_resume_check_notices_a_resume_that_loses_the_loss_scale(
    tmp_path: Path, data_dir: Path, fp16_run: Path, fp16_stopped: Path
):
    """Negative control: without the scaler's state the resumed run starts from the initial scale again,
    skips other steps, and ends elsewhere."""
    interrupted = Path(shutil.copytree(fp16_stopped, tmp_path / "run"))
    path = interrupted / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    state["grad_scaler"] = None
    torch.save(state, path)
    cifar10(3, interrupted, data_dir, "--epochs", "2", "--resume", *FP16)
    expected, resumed = final_weights(fp16_run), final_weights(interrupted)
    assert any(not torch.equal(expected[key], resumed[key]) for key in expected)
