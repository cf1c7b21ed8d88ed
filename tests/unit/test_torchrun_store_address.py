"""ddp_core.torchrun under c10d: every round's keys say where the workers' store is, whoever joined when.

torch's handler is stood for by a subclass that returns what torch's returns after a node range grew: rank 0 with the
address it learned in its first round, a node joining now that reads the round's keys for it, an agent still
holding the address of an earlier rank 0. The hosts test (tests/hosts/test_elastic.py) runs the real thing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from ddp_core.process.agent import EveryRoundStore

SERVED = RendezvousStoreInfo("10.90.0.1", 41000)  # rank 0's agent store, learned in round 0


@pytest.fixture
def round_store() -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=2))  # a key never written fails the test instead of hanging it
    return dist.PrefixStore("/torch.rendezvous.job.1", store)


def patched(monkeypatch, returned) -> EveryRoundStore:
    """torch's c10d handler (its own ``use_agent_store``) whose rendezvous returns ``returned(handler)``, wrapped as
    the launcher wraps it."""

    class Torchs(DynamicRendezvousHandler):
        def next_rendezvous(self) -> RendezvousInfo:
            return returned(self)

    return EveryRoundStore(object.__new__(Torchs))


def test_a_node_joining_a_later_round_learns_rank_0s_store_from_that_round(monkeypatch, round_store):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    rank_0 = patched(monkeypatch, lambda handler: RendezvousInfo(round_store, 0, 2, SERVED))
    assert rank_0.next_rendezvous().bootstrap_store_info == SERVED
    # torch's own first round for a node that is not rank 0: it reads the round's keys (RendezvousStoreInfo.build)
    joining = patched(
        monkeypatch,
        lambda handler: RendezvousInfo(round_store, 1, 2, RendezvousStoreInfo.build(1, round_store, "10.90.0.2")),
    )
    assert joining.next_rendezvous().bootstrap_store_info == SERVED
    stale = patched(monkeypatch, lambda handler: RendezvousInfo(round_store, 1, 2, RendezvousStoreInfo("10.90.0.3", 9)))
    info = stale.next_rendezvous()
    assert (info.rank, info.world_size, info.bootstrap_store_info) == (1, 2, SERVED)


def test_without_a_shared_store_torchs_answer_is_left_alone(monkeypatch, round_store):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # torch writes the keys in every round itself
    own = RendezvousStoreInfo("10.90.0.3", 9)
    handler = patched(monkeypatch, lambda handler: RendezvousInfo(round_store, 1, 2, own))
    assert handler.next_rendezvous().bootstrap_store_info == own
    assert not round_store.check([RendezvousStoreInfo.MASTER_ADDR_KEY])
