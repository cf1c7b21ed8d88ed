"""wrap_ddp's options: a world of one syncs no buffers (DDP would send them from rank 0 to itself every forward),
a larger world keeps DDP's default, and an explicit choice wins; the option's name is the installed torch's. A model
whose forward is torch's own gets one dynamo traces inside DDP, and stays the same model in every other way (the
tracing itself: tests/distributed/test_sync_batchnorm.py)."""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddp_core.distributed import group


@pytest.mark.parametrize(
    "world_size, options, broadcast",
    [(1, {}, False), (2, {}, None), (3, {}, None), (1, {group.BUFFER_SYNC_OPTION: True}, True)],
)
def test_buffers_are_broadcast_only_where_another_rank_can_receive_them(monkeypatch, world_size, options, broadcast):
    seen = {}
    monkeypatch.setattr(group.nn.parallel, "DistributedDataParallel", lambda model, **kw: seen.update(kw) or model)
    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=world_size)
    group.wrap_ddp(nn.BatchNorm1d(3), ctx, **options)
    assert seen.get(group.BUFFER_SYNC_OPTION) is broadcast and seen["device_ids"] is None  # None: DDP's default


class Mine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


@pytest.mark.parametrize(
    "build, given",
    [
        (lambda: nn.Sequential(nn.Linear(3, 2), nn.ReLU()), True),  # torch.nn's forward
        (lambda: nn.ModuleDict({"a": nn.Linear(3, 2)}), True),  # none at all: still torch's, still an error
        (Mine, False),  # its author's forward: dynamo traces it already
    ],
)
def test_a_model_whose_forward_is_torchs_gets_one_of_ddp_cores_and_stays_the_same_model(build, given):
    torch.manual_seed(0)
    plain = build()
    model = group.compilable_inside_ddp(copy.deepcopy(plain))
    assert ("forward" in vars(model)) is given and type(model) is type(plain)
    assert model.state_dict().keys() == plain.state_dict().keys()
    if given:
        assert model.forward.__func__.__module__ == group.__name__
    if isinstance(plain, nn.ModuleDict):
        with pytest.raises(NotImplementedError):
            model(torch.ones(4, 3))
        return
    x = torch.randn(4, 3)
    assert torch.equal(model(x), plain(x))
    copied = copy.deepcopy(model)
    assert copied.forward.__self__ is copied and torch.equal(copied(x), plain(x))
    saved = io.BytesIO()
    torch.save(model, saved)  # a whole model saved by torch.save loads again, and can be wrapped again
    saved.seek(0)
    loaded = group.compilable_inside_ddp(torch.load(saved, weights_only=False))
    assert torch.equal(loaded(x), plain(x)) and group.compilable_inside_ddp(loaded) is loaded
    if given:
        assert loaded.forward.__func__.__module__ == group.__name__
