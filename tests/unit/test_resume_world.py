"""ddp_core.output.run.world_size_change: another world size on a resume is refused, unless the user allowed it
(--allow-config-change) or asked for a changing world (an elastic node range)."""

from __future__ import annotations

import pytest

from ddp_core.errors import ConfigError
from ddp_core.output.checkpoint import Written
from ddp_core.output.run import world_size_change


@pytest.mark.parametrize(
    ("written", "now", "allowed", "elastic", "expected"),
    [
        (2, 2, False, None, []),
        (2, 2, True, "1:2", []),
        (2, 1, False, "1:2", ["world size: 2 -> 1"]),  # a node lost under --nnodes=1:2
        (1, 2, False, "1:2", ["world size: 1 -> 2"]),  # a node joined
        (4, 3, True, None, ["world size: 4 -> 3"]),  # --allow-config-change
        (2, 1, False, None, ConfigError),
        (3, 4, False, None, ConfigError),
    ],
)
def test_a_world_size_change_is_recorded_where_allowed_and_refused_elsewhere(written, now, allowed, elastic, expected):
    checkpoint = Written(world_size=written, experiment="toy", config={})
    if expected is ConfigError:
        with pytest.raises(ConfigError, match=f"written by {written} processes and this run has {now}"):
            world_size_change(checkpoint, now, allowed, elastic)
    else:
        assert world_size_change(checkpoint, now, allowed, elastic) == expected
