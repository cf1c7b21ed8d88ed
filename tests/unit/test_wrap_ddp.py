"""wrap_ddp's options: a world of one syncs no buffers (DDP would send them from rank 0 to itself every forward),
a larger world keeps DDP's default, and an explicit choice wins; the option's name is the installed torch's."""

from __future__ import annotations

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
