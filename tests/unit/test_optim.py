"""The optimizer's implementation per device (``fused_on``): fused on CUDA, torch's default elsewhere. The fused
update must train as the default one does and resume bitwise; torch's CPU fused kernels stand in for CUDA's here."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from bench.step_overhead import Step
from ddp_core.training.optim import fused_on, weight_decay_groups


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cuda", {"fused": True}), (torch.device("cuda", 1), {"fused": True}), ("cpu", {}), ("meta", {})],
)
def test_fused_only_on_cuda(device, expected):
    assert fused_on(torch.device(device)) == expected


def model() -> nn.Module:
    torch.manual_seed(0)  # no bias before a batch norm: Adam would scale its zero gradient's rounding up to lr
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


OPTIMIZERS = {
    "sgd": lambda groups, extra: torch.optim.SGD(groups, 0.1, 0.9, nesterov=True, **extra),
    "adamw": lambda groups, extra: torch.optim.AdamW(groups, lr=1e-2, **extra),
}


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(16, 10, generator=generator), torch.randn(16, 5, generator=generator)
        nn.functional.mse_loss(net(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_fused_update_trains_as_the_default_and_resumes_bitwise(name):
    make = OPTIMIZERS[name]
    default, fused = model(), model()
    train(default, make(weight_decay_groups(default, 5e-4), {}), range(6))
    optimizer = make(weight_decay_groups(fused, 5e-4), {"fused": True})
    train(fused, optimizer, range(3))
    saved = copy.deepcopy((fused.state_dict(), optimizer.state_dict()))
    train(fused, optimizer, range(3, 6))
    for a, b in zip(default.state_dict().values(), fused.state_dict().values()):
        torch.testing.assert_close(a, b)  # the same update, computed in one kernel (the last bits may differ)

    resumed = model()
    again = make(weight_decay_groups(resumed, 5e-4), {"fused": True})
    resumed.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    assert all(group["fused"] for group in again.param_groups)
    train(resumed, again, range(3, 6))
    for a, b in zip(fused.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_the_bench_steps_as_the_experiment_does_on_each_device():
    """bench.step_overhead's bare step uses the experiment's optimizer: fused on CUDA (its parameters may stay on the
    CPU here: torch's fused SGD accepts both)."""
    for device, fused in ((torch.device("cuda", 0), True), (torch.device("cpu"), None)):
        step = Step(model(), device, "eager", False, contextlib.nullcontext)
        assert step.optimizer.defaults["fused"] is fused
        assert [group["weight_decay"] for group in step.optimizer.param_groups] == [5e-4, 0.0]
