"""Run-directory decisions that need no process group."""

from __future__ import annotations

import pytest

from ddp_core.errors import ConfigError
from ddp_core.run import _refuse_a_checkpoint_on_another_host


def test_a_checkpoint_only_on_another_host_is_refused_naming_both():
    seen = [("node-b", None), ("node-a", "runs/toy/x/checkpoints/last.pt")]  # c10d made node-b rank 0
    with pytest.raises(ConfigError, match=r"rank 0 \(host node-b\) has no checkpoint .* rank 1 \(host node-a\) has runs/toy/x/checkpoints/last\.pt"):
        _refuse_a_checkpoint_on_another_host(seen)


@pytest.mark.parametrize("seen", [
    [("node-a", None), ("node-b", None)],  # nobody has one: the usual rules apply
    [("node-a", None), ("node-a", "runs/toy/x/checkpoints/last.pt")],  # same host: rank 0 would see it too
])
def test_no_refusal_without_a_checkpoint_elsewhere(seen):
    _refuse_a_checkpoint_on_another_host(seen)
