"""wrap_ddp's options: a world of one broadcasts no buffers (DDP would send them from rank 0 to itself every
forward), a larger world keeps DDP's default, and an explicit choice wins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddp_core.distributed import group


@pytest.mark.parametrize(
    "world_size, options, broadcast",
    [(1, {}, False), (2, {}, True), (3, {}, True), (1, {"broadcast_buffers": True}, True)],
)
def test_buffers_are_broadcast_only_where_another_rank_can_receive_them(monkeypatch, world_size, options, broadcast):
    seen = {}
    monkeypatch.setattr(group.nn.parallel, "DistributedDataParallel", lambda model, **kw: seen.update(kw) or model)
    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=world_size)
    group.wrap_ddp(nn.BatchNorm1d(3), ctx, **options)
    assert seen["broadcast_buffers"] is broadcast and seen["device_ids"] is None
