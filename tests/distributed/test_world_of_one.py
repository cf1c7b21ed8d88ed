"""With no launch variables, process_group() is a world of one, destroyed on exit even when the body raises."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_core.distributed import collectives
from ddp_core.distributed.group import process_group
from ddp_core.training.samplers import global_sum_count
from tests.distributed.test_init_failures import LAUNCH_ENV


class Boom(Exception):
    pass


@pytest.fixture
def no_launch_env(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


def test_world_of_one_is_created_and_destroyed(no_launch_env):
    with process_group() as ctx:
        assert dist.is_initialized()
        assert (dist.get_world_size(), dist.get_rank()) == (1, 0)
        assert (ctx.world_size, ctx.rank, ctx.backend) == (1, 0, "gloo")
        tensor = torch.tensor([3.0])
        dist.all_reduce(tensor)  # a real group: collectives work
        assert tensor.item() == 3.0
        assert collectives.all_gather_object({"a": 1}) == [{"a": 1}]
        assert global_sum_count(5.0, 2) == (5.0, 2)
    assert not dist.is_initialized()


def test_world_of_one_is_destroyed_when_the_body_raises(no_launch_env):
    with pytest.raises(Boom):
        with process_group():
            assert dist.get_world_size() == 1
            raise Boom()
    assert not dist.is_initialized()
    with process_group():  # and a new one can be created afterwards
        assert dist.get_world_size() == 1
    assert not dist.is_initialized()
