"""Process-group init failures say what happened in words (ddp_core/distributed/group.py)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from ddp_core.distributed.env import TORCHRUN_VARIABLES
from ddp_core.distributed.group import DistConfig, DistInitError, process_group
from ddp_core.process.launch import free_port
from tests.distributed.harness import spawn_ranks
from tests.distributed.workers import one_node_cannot_choose, try_process_group

LAUNCH_ENV = (*TORCHRUN_VARIABLES, "INIT_METHOD", "BACKEND")


def test_port_already_in_use(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # rank 0 of a 2-rank launch must host the store on MASTER_PORT, which another process holds
        outcome = spawn_ranks(try_process_group, 2, [0], 5.0, tmp_dir=tmp_path, port=port)[0]
    assert outcome["type"] == "DistInitError", outcome
    assert "already in use" in outcome["message"] and str(port) in outcome["message"], outcome["message"]
    assert outcome["initialized_after"] is False


@pytest.fixture(scope="module")
def two_of_three(tmp_path_factory) -> dict[int, dict]:
    """A 3-rank launch in which rank 2 never starts."""
    return spawn_ranks(try_process_group, 3, [0, 1], 3.0, tmp_dir=tmp_path_factory.mktemp("two_of_three"))


def test_missing_rank_is_named_by_rank_0(two_of_three):
    outcome = two_of_three[0]
    assert outcome["type"] == "DistInitError", outcome
    assert "only 2 of 3 ranks joined" in outcome["message"], outcome["message"]
    assert "missing ranks: 2" in outcome["message"], outcome["message"]
    assert outcome["initialized_after"] is False


def test_missing_rank_is_reported_in_words_on_the_other_ranks_too(two_of_three):
    """Rank 1 waits as long as rank 0; when rank 0 gives up first its store goes away, and rank 1 must
    still get a DistInitError in words, not torch's raw 'Failed to recv, got 0 bytes'."""
    outcome = two_of_three[1]
    assert outcome["type"] == "DistInitError", outcome
    assert "of 3 ranks" in outcome["message"], outcome["message"]
    assert outcome["initialized_after"] is False


def test_rank_0_unreachable(monkeypatch):
    """In-process: the store client never connects, so no process group is created here."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    port = free_port()  # nothing listens there
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(DistInitError) as raised:
        with process_group(DistConfig(backend="gloo", timeout_s=2)):
            pytest.fail("the group formed without rank 0")
    message = str(raised.value)
    assert "unreachable" in message and f"127.0.0.1:{port}" in message, message
    assert not dist.is_initialized()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_node_that_cannot_choose_its_interface_stops_every_node_at_once(tmp_path, world_size: int):
    """One line on every node, exit 2 (NodeConfigError), long before the group's 120 s timeout: the
    harness gives up after 60 s, so a rank left waiting for the failed node fails the test."""
    failing = 1
    outcomes = spawn_ranks(
        one_node_cannot_choose, world_size, range(world_size), failing, 120.0, tmp_dir=tmp_path, join_timeout_s=60
    )
    assert outcomes[failing]["type"] == "NodeConfigError", outcomes
    assert outcomes[failing]["message"].startswith("GLOO_SOCKET_IFNAME='eth9'"), outcomes[failing]
    for rank in set(range(world_size)) - {failing}:
        assert outcomes[rank]["type"] == "NodeConfigError", outcomes[rank]
        assert outcomes[rank]["message"].startswith(f"node {failing} ("), outcomes[rank]
        assert (
            "cannot start: GLOO_SOCKET_IFNAME='eth9': this host has no interface named eth9"
            in outcomes[rank]["message"]
        )
    assert not any(o["initialized_after"] for o in outcomes.values())
