"""DDP's communication knobs on GPUs, under nccl: each hook (bf16 and fp16 compress the gradients on the GPU,
PowerSGD's factors are GPU matrices) and --zero, stopped and resumed with --deterministic, end with the weights
of the run that never stopped, bit for bit. On every GPU of the machine (one GPU: a world of one, where the
hooks still run on every bucket). Selected with `pytest -m gpu` (make gpu-check); skipped without CUDA.
The CPU (gloo) versions at 2 and 3 processes are tests/e2e/test_comm_knobs.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.launch import final_weights, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOY = ("--dataset-size", "512", "--batch-size", "16", "--steps", "24", "--checkpoint-every", "9")
COMMON = ("--backend", "nccl", "--deterministic", *TOY)
KNOBS = {
    "bf16": ("--comm-hook", "bf16"),
    "fp16": ("--comm-hook", "fp16"),
    "powersgd": ("--comm-hook", "powersgd", "--powersgd-start-step", "3"),
    "zero": ("--zero",),
}


def toy(run_dir: Path, *extra: str) -> None:
    torchrun(
        max(1, torch.cuda.device_count()),
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        *COMMON,
        *extra,
        timeout=300,
        python=sys.executable,
    )


@pytest.mark.parametrize("knob", KNOBS)
def test_a_knob_on_nccl_stopped_and_resumed_is_bitwise(tmp_path, knob):
    toy(tmp_path / "whole", *KNOBS[knob])
    toy(tmp_path / "run", *KNOBS[knob], "--stop-at-step", "11")
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 11
    toy(tmp_path / "run", *KNOBS[knob], "--resume")
    expected, resumed = final_weights(tmp_path / "whole"), final_weights(tmp_path / "run")
    assert [key for key in expected if not torch.equal(expected[key], resumed[key])] == []
    assert all(torch.isfinite(value).all() for value in resumed.values())
