"""Objects sent through ddp_core.distributed.collectives: a tensor on the sender's GPU arrives on the receiver's device.

No GPU here: a tensor on ``meta`` stands in for one on another rank's GPU (its CPU copy is faked, since
a meta tensor has no data), and the receiving side maps to ``cpu`` or ``meta``. The wire is pickle, as
in torch.distributed's object collectives.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict, defaultdict
from typing import NamedTuple

import pytest
import torch

from ddp_core.distributed import collectives
from ddp_core.distributed.collectives import as_received, for_sending


class Pair(NamedTuple):
    first: torch.Tensor
    second: int


def over_the_wire(obj):
    return pickle.loads(pickle.dumps(obj))


def leaves(obj):
    """Every tensor in ``obj``, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for value in values for t in leaves(value)]


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """Meta tensors play the sender's GPU tensors; their "host copy" is arange(numel), the data they would hold."""
    monkeypatch.setattr(collectives, "_host_copy", lambda t: torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape))


def nested(device: str, requires_grad: bool = False) -> dict:
    state = OrderedDict(w=torch.empty(2, 3, device=device, requires_grad=requires_grad))
    state._metadata = {"": {"version": 2}}  # what a module's state_dict carries
    return {
        "state": state,
        "list": [torch.empty(4, device=device), 7],
        "pair": Pair(torch.empty(1, device=device), 3),
        "tuple": (torch.empty(2, device=device),),
        "text": "kept",
    }


@pytest.mark.parametrize(
    "obj",
    [
        nested("cpu"),
        [torch.ones(2), {"a": (torch.zeros(1), "x")}],
        (1, "two", None),
        torch.arange(3),
        "a string",
    ],
)
def test_objects_without_gpu_tensors_pass_through_untouched(obj):
    """On CPU (gloo) nothing is copied: the very same object is sent and kept."""
    assert for_sending(obj) is obj
    assert as_received(obj, torch.device("meta")) is obj


def test_a_tensor_from_the_senders_gpu_lands_on_this_ranks_device(gpu_stand_in):
    sent = over_the_wire(for_sending(nested("meta")))
    got = as_received(sent, torch.device("cpu"))
    assert [t.device.type for t in leaves(got)] == ["cpu"] * 4
    assert torch.equal(got["state"]["w"], torch.arange(6.0).reshape(2, 3)) and torch.equal(
        got["list"][0], torch.arange(4.0)
    )
    # the containers are what they were
    assert type(got["state"]) is OrderedDict and got["state"]._metadata == {"": {"version": 2}}
    assert isinstance(got["pair"], Pair) and got["pair"].second == 3
    assert type(got["tuple"]) is tuple and got["list"][1] == 7 and got["text"] == "kept"


def test_received_tensors_go_to_the_device_asked_for():
    sent = over_the_wire(for_sending({"t": torch.ones(2)}))  # CPU tensors are not marked: they stay on CPU
    assert as_received(sent, torch.device("meta"))["t"].device.type == "cpu"
    marked = collectives._FromDevice(torch.ones(2), requires_grad=False)
    assert as_received([marked], torch.device("meta"))[0].device.type == "meta"


@pytest.mark.parametrize("requires_grad", [True, False])
def test_requires_grad_survives(gpu_stand_in, requires_grad):
    got = as_received(over_the_wire(for_sending(nested("meta", requires_grad))), torch.device("cpu"))
    assert got["state"]["w"].requires_grad is requires_grad


def test_a_dict_subclass_that_cannot_be_rebuilt_becomes_a_plain_dict(gpu_stand_in):
    counts = defaultdict(list, {"t": torch.empty(1, device="meta")})
    got = as_received(over_the_wire(for_sending(counts)), torch.device("cpu"))
    assert type(got) is dict and got["t"].device.type == "cpu"
