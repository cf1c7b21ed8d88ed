"""A checkpoint as named states (ddp_core/lifecycle/states.py, checkpointer.py): an experiment's own objects saved
and restored by name, the names checked on resume in one line, per-rank state afresh at another world size,
ZeRO's state joined from every rank's share through public API alone, and the fingerprint that compares a
replicated object across ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.lifecycle.states import Kind, NamedStates
from ddp_core.training.comm import ShardedOptimizerState, shard_optimizer
from ddp_core.training.replicas import state_fingerprint
from experiments.toy import ToyModel
from tests.checkpointing import StandInRun, checkpointer


class Counter:
    """An experiment's own object, written apart from ddp-lab's parts."""

    def __init__(self) -> None:
        self.seen, self.total = 0, torch.zeros(3)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "total": self.total.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.total = state["seen"], state["total"].clone()


def tracked(*parts: tuple[str, object, Kind]) -> NamedStates:
    states = NamedStates()
    for name, part, kind in parts:
        states.add(name, part, kind, tracked=True)
    return states


def saved_with(*parts: tuple[str, object, Kind]) -> dict:
    run = StandInRun()
    parts_now = checkpointer(ToyModel(), None, run)
    for named in tracked(*parts):
        parts_now.states.add(named.name, named.part, named.kind, tracked=True)
    parts_now.save(3)
    assert run.written is not None
    return run.written


def resumed_with(checkpoint: dict, *parts: tuple[str, object, Kind], other_world: bool = False) -> None:
    parts_now = checkpointer(ToyModel(), None, StandInRun(checkpoint=checkpoint), other_world=other_world)
    for named in tracked(*parts):
        parts_now.states.add(named.name, named.part, named.kind, tracked=True)
    parts_now.resume(1, 0, on_undo=lambda: None)


def test_a_tracked_object_is_saved_by_name_and_restored_into_a_fresh_one():
    counter, mine = Counter(), Counter()
    counter.seen, counter.total = 7, torch.tensor([1.0, 2.0, 3.0])
    mine.seen = 2
    checkpoint = saved_with(("counter", counter, Kind.REPLICATED), ("mine", mine, Kind.PER_RANK))
    assert checkpoint["counter"]["seen"] == 7 and torch.equal(checkpoint["counter"]["total"], counter.total)
    assert [state["seen"] for state in checkpoint["mine"]] == [2]  # a list by rank
    assert checkpoint["per_rank"] == ["rng", "comm_hook", "mine"]
    fresh, fresh_mine = Counter(), Counter()
    resumed_with(checkpoint, ("counter", fresh, Kind.REPLICATED), ("mine", fresh_mine, Kind.PER_RANK))
    assert fresh.seen == 7 and torch.equal(fresh.total, counter.total) and fresh_mine.seen == 2
    fresh.total += 1  # a copy was loaded: the checkpoint (which a replay loads again) is unchanged
    assert torch.equal(checkpoint["counter"]["total"], torch.tensor([1.0, 2.0, 3.0]))


def test_at_another_world_size_replicated_state_carries_over_and_per_rank_state_starts_afresh():
    counter, mine = Counter(), Counter()
    counter.seen = mine.seen = 5
    checkpoint = saved_with(("counter", counter, Kind.REPLICATED), ("mine", mine, Kind.PER_RANK))
    checkpoint["world_size"] = 2  # as if written by two processes
    checkpoint["mine"] = checkpoint["mine"] * 2
    checkpoint["rng"] = checkpoint["rng"] * 2
    checkpoint["comm_hook"] = checkpoint["comm_hook"] * 2
    fresh, fresh_mine = Counter(), Counter()
    resumed_with(checkpoint, ("counter", fresh, Kind.REPLICATED), ("mine", fresh_mine, Kind.PER_RANK), other_world=True)
    assert fresh.seen == 5 and fresh_mine.seen == 0


def test_a_missing_or_unexpected_name_on_resume_is_one_line_exit_2(capsys):
    checkpoint = saved_with(("counter", Counter(), Kind.REPLICATED))
    with pytest.raises(SystemExit) as info:
        exits_with_one_line(resumed_with)(checkpoint, ("other", Counter(), Kind.REPLICATED))
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "holds no state named other and counter, which this run does not track" in lines[0]


@pytest.mark.parametrize(
    ("name", "part", "why"),
    [
        ("model", Counter(), "is taken"),
        ("2nd", Counter(), "a name is letters"),
        ("plain", object(), "has no state_dict() and load_state_dict(state)"),
    ],
)
def test_a_tracked_name_or_object_that_cannot_be_saved_is_refused_when_tracked(name, part, why):
    with pytest.raises(ConfigError, match=rf"run.track\('{name}', ...\): .*{why.replace('(', '.').replace(')', '.')}"):
        tracked((name, part, Kind.REPLICATED))


def test_a_replicated_objects_fingerprint_is_one_pair_that_any_change_moves():
    device = torch.device("cpu")
    a, b = Counter(), Counter()
    assert torch.equal(state_fingerprint(a.state_dict(), device), state_fingerprint(b.state_dict(), device))
    for change in (lambda c: setattr(c, "seen", 1), lambda c: c.total.__setitem__(2, 1e-30)):
        other = Counter()
        change(other)
        fingerprint = state_fingerprint(other.state_dict(), device)
        assert fingerprint.shape == (2,) and not torch.equal(fingerprint, state_fingerprint(a.state_dict(), device))
    swapped = Counter()
    swapped.total = torch.tensor([0.0, 1.0, 0.0])
    moved = Counter()
    moved.total = torch.tensor([1.0, 0.0, 0.0])
    assert not torch.equal(
        state_fingerprint(swapped.state_dict(), device), state_fingerprint(moved.state_dict(), device)
    )


def test_zeros_state_joined_from_the_shares_is_what_zero_itself_consolidates_and_nothing_stays_behind(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1}]
        groups.append({"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0})
        sharded = shard_optimizer(torch.optim.AdamW(groups, lr=0.01))
        for _ in range(2):
            model(torch.randn(5, 4)).pow(2).sum().backward()
            sharded.step()
            sharded.zero_grad()
        part = ShardedOptimizerState(sharded)
        joined = part.join([part.state_dict()])
        assert getattr(sharded, "_all_state_dicts") == []  # read only: nothing was gathered and kept
        sharded.consolidate_state_dict(to=0)
        expected = sharded.state_dict()
        assert joined["param_groups"] == expected["param_groups"]
        assert joined["state"].keys() == expected["state"].keys() == {0, 1, 2, 3}
        for index, state in expected["state"].items():
            assert all(torch.equal(joined["state"][index][key], value) for key, value in state.items())
        part.load_state_dict(joined)  # re-sharded
    finally:
        dist.destroy_process_group()


def test_the_contract_names_the_tracked_state_that_a_resume_did_not_put_back():
    from tools.contract import compare_states

    whole = {"drift": {"mean": [torch.ones(2)], "count": 8}, "tally": [{"total": torch.zeros(3)}]}
    assert (
        compare_states(whole, {"drift": {"mean": [torch.ones(2)], "count": 8}, "tally": [{"total": torch.zeros(3)}]})
        is None
    )
    assert compare_states(whole, {**whole, "drift": {"mean": [torch.ones(2)], "count": 3}}) == "drift.count"
    assert (
        compare_states(whole, {**whole, "drift": {"mean": [torch.tensor([1.0, 1.5])], "count": 8}}) == "drift.mean[0]"
    )
    assert compare_states(whole, {"drift": whole["drift"]}) == "tally"
