"""Mixed precision (ddp_core.training.amp): the dtype each device gets, the GradScaler's skipped steps and its
state in a checkpoint. CUDA is simulated by monkeypatching torch.cuda's queries; the fp16 + GradScaler
path runs for real on CPU."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

from ddp_core.errors import ConfigError
from ddp_core.training.amp import AmpPlan, ScalerState, choose_amp
from ddp_core.training.guard import NonFiniteGuard
from experiments import cifar10
from experiments.cifar10_data import dataset_folder

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA GPU as torch.cuda describes it; ``gpu(native_bf16)`` picks its generation."""

    def make(native_bf16: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        # The real function says True on a V100 unless asked for native support: emulated bf16 is slow.
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or native_bf16
        )

    return make


def test_amp_is_off_by_default_on_cpu_and_bf16_on_a_gpu_with_native_bf16(gpu):
    assert choose_amp(CPU, None) == AmpPlan("cpu")
    gpu(native_bf16=True)
    plan = choose_amp(CUDA, None)
    assert (plan.dtype, plan.needs_scaler, plan.describe()) == (torch.bfloat16, False, "bf16")


def test_a_gpu_without_native_bf16_gets_fp16_with_a_grad_scaler(gpu):
    gpu(native_bf16=False)  # T4, V100
    plan = choose_amp(CUDA, None)
    assert (plan.dtype, plan.needs_scaler, plan.describe()) == (torch.float16, True, "fp16 + GradScaler")
    assert choose_amp(CUDA, None, "bf16").dtype == torch.bfloat16  # forced: emulated, but what was asked
    assert choose_amp(CUDA, False) == AmpPlan("cuda")


def test_cpu_autocast_on_request_bf16_by_default_fp16_when_forced():
    assert choose_amp(CPU, True).describe() == "bf16"
    assert choose_amp(CPU, True, "fp16").describe() == "fp16 + GradScaler"
    assert choose_amp(CPU, None, "fp16").describe() == "fp16 + GradScaler"  # a forced dtype turns autocast on
    assert choose_amp(CPU, False, "auto").describe() == "off"
    with pytest.raises(ValueError, match="auto, bf16, fp16"):
        choose_amp(CPU, True, "fp8")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_runs_the_model_in_the_chosen_dtype_and_keeps_float32_weights(dtype):
    plan = choose_amp(CPU, True, dtype)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    with plan.autocast():
        out = model(torch.randn(2, 3, 8, 8))
        loss = nn.functional.cross_entropy(out, torch.tensor([0, 1]))
    assert out.dtype == plan.dtype and loss.dtype == torch.float32  # the loss in float32, as autocast keeps it
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert plan.grad_scaler().is_enabled() == (dtype == "fp16")


def _fp16_steps(init_scale: float, steps: int) -> tuple[nn.Module, torch.amp.GradScaler, list[bool], NonFiniteGuard]:
    """SGD steps with fp16 autocast and a GradScaler on CPU, the guard watching the loss as in cifar10.fit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plan = choose_amp(CPU, True, "fp16")
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    guard = NonFiniteGuard(CPU)
    skipped = []
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
        before = [p.detach().clone() for p in model.parameters()]
        with plan.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        guard.observe(loss, step)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return model, scaler, skipped, guard


def test_overflowing_fp16_steps_are_skipped_and_the_guard_lets_them_pass():
    model, scaler, skipped, guard = _fp16_steps(init_scale=2.0**40, steps=30)
    assert skipped[0] and not skipped[-1]  # scaled gradients overflowed float16 at first, then fit
    assert scaler.get_scale() < 2.0**40
    guard.check(30, model)  # raises DivergedError if it saw a non-finite loss or weight
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_scaler_state_survives_a_weights_only_checkpoint_and_resumes_the_same_steps():
    _, scaler, _, _ = _fp16_steps(init_scale=2.0**40, steps=12)
    buffer = io.BytesIO()
    torch.save({"grad_scaler": ScalerState(scaler).state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["grad_scaler"]
    resumed = torch.amp.GradScaler("cpu")
    ScalerState(resumed).load_state_dict(loaded)
    assert resumed.state_dict() == scaler.state_dict() and resumed.get_scale() < 2.0**40
    assert ScalerState(torch.amp.GradScaler("cpu", enabled=False)).state_dict() is None
    assert ScalerState(None).state_dict() is None


def test_a_scaler_mismatch_on_resume_is_named(caplog):
    with caplog.at_level(logging.WARNING):
        ScalerState(torch.amp.GradScaler("cpu")).load_state_dict(None)
        ScalerState(torch.amp.GradScaler("cpu", enabled=False)).load_state_dict({"scale": 8.0})
        ScalerState(torch.amp.GradScaler("cpu", enabled=False)).load_state_dict(None)
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2 and "no GradScaler state" in said[0] and "is dropped" in said[1], said


# ------------------------------------------------------------------------ the experiment's flags


@pytest.fixture
def data_dir(tmp_path):
    dataset_folder(tmp_path).mkdir(parents=True)  # validate only looks for the folder
    return str(tmp_path)


def test_amp_on_cpu_is_accepted(data_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cifar10.validate(cifar10.Cifar10Args(data_dir=data_dir, amp=True, amp_dtype="fp16"))


def test_no_amp_with_a_forced_dtype_is_a_config_error(data_dir):
    with pytest.raises(ConfigError, match="--no-amp turns autocast off but --amp-dtype=fp16 wants it"):
        cifar10.validate(cifar10.Cifar10Args(data_dir=data_dir, amp=False, amp_dtype="fp16"))
    cifar10.validate(cifar10.Cifar10Args(data_dir=data_dir, amp_dtype="bf16"))
