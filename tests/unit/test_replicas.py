"""The replica check's parts without a process group: what is compared, how a tensor is fingerprinted, and
the one line that names the first differing tensor and the ranks that differ. The check at 3 processes, a
rank perturbing a weight, is in tests/e2e/test_replica_check.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddp_core.distributed.sync_batchnorm import GlobalBatchNorm
from ddp_core.training.replicas import ReplicaCheck, compared_tensors, disagreement, fingerprint


def test_compared_tensors_are_the_parameters_and_the_buffers_ddp_keeps_equal():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.Linear(4, 2), nn.SyncBatchNorm(2)), GlobalBatchNorm(2)
    )
    names = [name for name, _ in compared_tensors(model)]
    assert names == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.0.weight",
        "2.0.bias",
        "2.1.weight",
        "2.1.bias",
        "3.weight",
        "3.bias",
        "1.num_batches_tracked",  # every rank counts the same batches
        "2.1.running_mean",
        "2.1.running_var",
        "2.1.num_batches_tracked",  # synchronized: equal on every rank
        "3.running_mean",
        "3.running_var",
        "3.num_batches_tracked",
    ]
    # a plain batch norm's running statistics come from each rank's own batch: never flagged


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
)
def test_a_change_of_one_element_or_a_swap_changes_the_fingerprint(dtype):
    tensor = (torch.arange(24).reshape(4, 6) % 7 + 1).to(dtype)
    before = fingerprint(tensor)
    assert torch.equal(before, fingerprint(tensor.clone()))  # deterministic
    changed = tensor.clone()
    changed[2, 3] += 1
    swapped = tensor.clone().reshape(-1)
    swapped[[0, 5]] = swapped[[5, 0]]
    assert not torch.equal(before, fingerprint(changed))
    assert not torch.equal(before, fingerprint(swapped.reshape(4, 6)))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=50), position=st.integers(0, 49))
def test_the_smallest_float32_change_is_seen(values, position):
    tensor = torch.tensor(values, dtype=torch.float32)
    nudged = tensor.clone()
    index = position % len(values)
    nudged[index] = torch.nextafter(tensor[index], torch.tensor(float("inf")))
    if torch.equal(nudged.view(torch.int32), tensor.view(torch.int32)):  # +inf has no next value
        return
    assert not torch.equal(fingerprint(tensor), fingerprint(nudged))


def table_of(*ranks: list[int]) -> torch.Tensor:
    """(ranks, tensors, 2) fingerprints from one number per tensor."""
    return torch.tensor([[[value, value] for value in rank] for rank in ranks], dtype=torch.int64)


NAMES = ["net1.weight", "net1.bias", "net2.weight"]


@pytest.mark.parametrize(
    ("table", "line"),
    [
        (table_of([1, 2, 3], [1, 2, 3], [1, 2, 3]), None),
        (table_of([1, 2, 3], [1, 2, 3], [1, 9, 3]), "net1.bias: rank(s) 2 differ from rank(s) 0, 1"),
        (
            table_of([1, 2, 3], [1, 2, 3], [1, 9, 9]),
            "net1.bias: rank(s) 2 differ from rank(s) 0, 1 (1 more tensor(s) differ)",
        ),
        (table_of([5, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]), "net1.weight: rank(s) 0 differ from rank(s) 1, 2, 3"),
        (table_of([1, 2, 3], [1, 2, 4]), "net2.weight: ranks 0 vs 1 disagree, with no majority"),
        (
            table_of([1, 2, 3], [1, 2, 3], [1, 7, 3], [1, 7, 3]),
            "net1.bias: ranks 0, 1 vs 2, 3 disagree, with no majority",
        ),
        (table_of([1, 2, 3], [1, 8, 3], [1, 7, 3], [1, 2, 3]), "net1.bias: rank(s) 1, 2 differ from rank(s) 0, 3"),
    ],
)
def test_the_line_names_the_first_differing_tensor_and_the_ranks_outside_the_majority(table, line):
    assert disagreement(table, NAMES) == line


def test_without_a_process_group_every_check_agrees():
    check = ReplicaCheck(nn.Linear(2, 2), torch.device("cpu"))
    check.check(7)
    assert check.last_agreed == 7
