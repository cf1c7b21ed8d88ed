"""CIFAR10's steady state on a GPU, selected with `pytest -m gpu` (make gpu-check):

- its steps 24-38 (the second epoch but its ends: no evaluation or checkpoint, and four log points, read late as
  on every GPU) run under ``torch.cuda.set_sync_debug_mode("error")``: any call that makes the host wait for the
  GPU raises, so the host queues steps ahead and the GPU never idles on it (tests/e2e/test_host_syncs.py counts
  the same on CPU);
- stopped mid-epoch and resumed under --deterministic it ends bitwise where the uninterrupted run ends, eager,
  with --compile and with --cuda-graphs.

Skipped without CUDA ("needs CUDA").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from experiments import cifar10
from tests.e2e.launch import final_weights, torchrun
from tests.gpu.test_amp_sync_bn import FAST, data_dir  # noqa: F401 (a fixture)
from tests.steady_state import watch_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = {"eager": (), "compile": ("--compile",), "cuda-graphs": ("--cuda-graphs",)}


@pytest.mark.parametrize("mode", MODES)
def test_the_steady_state_step_never_makes_the_host_wait_for_the_gpu(tmp_path: Path, data_dir: Path, mode: str):  # noqa: F811
    """1280 images / batch 64 = 20 steps an epoch; the run evaluates and checkpoints at epoch ends only, and logs
    every 4 steps, each log point read at the next (--log-reads auto: late on CUDA)."""
    argv = [
        *("--model", "small", "--epochs", "2", "--batch-size", "64", "--log-every", "4", "--no-verify"),
        *("--data-dir", str(data_dir), "--run-dir", str(tmp_path / "run"), *MODES[mode]),
    ]
    with watch_steps(
        24, 38, lambda: torch.cuda.set_sync_debug_mode("error"), lambda: torch.cuda.set_sync_debug_mode(0)
    ):
        try:
            metrics = cifar10.main(argv)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert metrics["steps"] == 40


def launch(run_dir: Path, data: Path, *extra: str) -> None:
    exact = ("--deterministic", "--checkpoint-every", "4")
    torchrun(
        1,
        "experiments.cifar10",
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data),
        *FAST,
        *exact,
        *extra,
        timeout=600,
        python=sys.executable,
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_run_stopped_and_resumed_ends_bitwise_in_every_mode(tmp_path: Path, data_dir: Path, mode: str):  # noqa: F811
    launch(tmp_path / "whole", data_dir, *MODES[mode])
    launch(tmp_path / "parts", data_dir, *MODES[mode], "--stop-at-step", "7")
    assert torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)["step"] == 7
    launch(tmp_path / "parts", data_dir, *MODES[mode], "--resume")
    whole, parts = final_weights(tmp_path / "whole"), final_weights(tmp_path / "parts")
    assert [key for key in whole if not torch.equal(whole[key], parts[key])] == []
