"""--heal's worker side, in one process: the refusals, and the optimizer that steps only a committed step."""

from __future__ import annotations

import pytest
import torch

from ddp_core.errors import ConfigError
from ddp_core.experiment import check_training_args
from ddp_core.lifecycle.heal import CommitGate
from experiments.toy import ToyArgs


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"comm_hook": "powersgd"}, "--comm-hook"),
        ({"zero": True}, "--zero"),
        ({"static_graph": True}, "--static-graph"),
    ],
)
def test_under_heal_what_torchft_cannot_carry_is_refused_in_one_line(monkeypatch, flags, named):
    monkeypatch.setenv("DDP_LAB_HEAL", "1")
    with pytest.raises(ConfigError) as refused:
        check_training_args(ToyArgs(**flags))
    assert str(refused.value).startswith(f"--heal cannot carry {named}:") and "\n" not in str(refused.value)
    monkeypatch.delenv("DDP_LAB_HEAL")
    check_training_args(ToyArgs(**flags))  # without --heal each is fine


class Verdict:
    def __init__(self, commits: bool) -> None:
        self.commits, self.asked = commits, 0

    def commit(self) -> bool:
        self.asked += 1
        return self.commits


@pytest.mark.parametrize("commits", [True, False])
def test_the_optimizer_steps_only_a_step_that_commits(commits: bool):
    weight = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([weight], lr=0.5, momentum=0.9)
    verdict = Verdict(commits)
    gate = CommitGate(inner, verdict)
    weight.grad = torch.ones(3)
    gate.step()
    assert verdict.asked == 1
    assert torch.equal(weight.detach(), torch.full((3,), 0.5) if commits else torch.ones(3))
    assert bool(inner.state) is commits  # no momentum buffer from an abandoned step
    gate.zero_grad(set_to_none=True)  # everything else is the experiment's optimizer's
    assert weight.grad is None and gate.param_groups is inner.param_groups
