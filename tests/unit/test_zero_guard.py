"""--zero hands the experiment a sharded optimizer: stepping the original one instead (it would train on while
the checkpoint keeps the sharded state, which never moved) is refused in one line, and the sharded one steps."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_core.errors import ConfigError
from ddp_core.training.comm import shard_optimizer


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.AdamW])
def test_stepping_the_original_optimizer_after_sharding_is_refused(tmp_path, kind):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        model = nn.Linear(4, 2)
        original = kind(model.parameters(), lr=0.1)
        sharded = shard_optimizer(original)
        model(torch.ones(3, 4)).sum().backward()
        before = model.weight.detach().clone()
        with pytest.raises(ConfigError, match=rf"--zero: this {kind.__name__} was sharded; step the optimizer"):
            original.step()
        assert torch.equal(model.weight, before)  # refused before it changed anything
        sharded.step()
        assert not torch.equal(model.weight, before)
    finally:
        dist.destroy_process_group()
