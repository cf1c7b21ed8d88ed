"""TrainSampler and EvalSampler: coverage, padding, disjointness, epochs and mid-epoch resume, no process group."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from ddp_core.training.samplers import EvalSampler, TrainSampler, global_sum_count

GRID = list(itertools.product(range(1, 24), range(1, 6)))  # (num_samples, world_size)
SEED = 1234


def shards(num_samples, world_size, epoch=0, **kwargs) -> list[list[int]]:
    result = []
    for rank in range(world_size):
        sampler = TrainSampler(num_samples, rank, world_size, **kwargs)
        sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


def interleave(parts: list[list[int]]) -> list[int]:
    """Undo the rank striding: position i * W + r of the global order is rank r's i-th index."""
    return [part[i] for i in range(len(parts[0])) for part in parts]


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "ordered"])
@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "drop_last"])
@pytest.mark.parametrize("num_samples, world_size", GRID)
def test_train_sampler_partition(num_samples, world_size, drop_last, shuffle):
    parts = shards(num_samples, world_size, seed=SEED, shuffle=shuffle, drop_last=drop_last)
    per_rank = num_samples // world_size if drop_last else math.ceil(num_samples / world_size)
    total = per_rank * world_size

    # equal sizes on every rank, so ranks run the same number of steps
    for rank, part in enumerate(parts):
        assert len(part) == per_rank
        assert (
            len(TrainSampler(num_samples, rank, world_size, seed=SEED, shuffle=shuffle, drop_last=drop_last))
            == per_rank
        )

    counts = Counter(itertools.chain.from_iterable(parts))
    assert set(counts) <= set(range(num_samples))
    assert sum(counts.values()) == total
    if drop_last:
        # no padding: all distinct, and only the remainder (N mod W samples) is left out this epoch
        assert all(c == 1 for c in counts.values())
        assert len(counts) == total
        assert num_samples - len(counts) == num_samples % world_size
    else:
        # every index covered; the padded duplicates are exactly total - N
        assert set(counts) == set(range(num_samples))
        assert sum(c - 1 for c in counts.values()) == total - num_samples
        if num_samples % world_size == 0:
            for a, b in itertools.combinations(parts, 2):
                assert not set(a) & set(b)

    # ranks interleave into one permutation of range(N), same on every rank; padding wraps around it
    order = interleave(parts)
    if drop_last:
        assert len(set(order)) == len(order)
    else:
        assert sorted(order[:num_samples]) == list(range(num_samples))
        assert all(order[i] == order[i % num_samples] for i in range(num_samples, total))
    if not shuffle:
        assert order[: min(total, num_samples)] == list(range(min(total, num_samples)))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_samples, world_size", [(1, 1), (7, 3), (10, 3), (23, 5), (4, 5), (64, 4)])
def test_train_sampler_matches_distributed_sampler(num_samples, world_size, drop_last):
    """The contract: 'exactly as DistributedSampler does' for a full epoch after set_epoch."""
    for epoch in (0, 3):
        for rank in range(world_size):
            ours = TrainSampler(num_samples, rank, world_size, seed=SEED, drop_last=drop_last)
            reference = DistributedSampler(
                range(num_samples), num_replicas=world_size, rank=rank, seed=SEED, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            reference.set_epoch(epoch)
            assert list(ours) == list(reference)


def test_shuffled_order_is_the_permutation_drawn_from_seed_plus_epoch():
    num_samples, world_size, epoch = 30, 3, 2
    expected = torch.randperm(num_samples, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    assert interleave(shards(num_samples, world_size, epoch=epoch, seed=SEED)) == expected


def test_documented_example_ten_samples_three_ranks():
    """The table in ddp_core/training/samplers.py's docstring."""
    padded = shards(10, 3, shuffle=False, drop_last=False)
    assert padded == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    dropped = shards(10, 3, shuffle=False, drop_last=True)
    assert dropped == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_different_epochs_give_different_orders():
    orders = [interleave(shards(50, 2, epoch=epoch, seed=SEED)) for epoch in range(4)]
    for a, b in itertools.combinations(orders, 2):
        assert sorted(a) == sorted(b) and a != b


def test_different_seeds_give_different_orders():
    assert shards(50, 2, seed=0) != shards(50, 2, seed=1)
    assert shards(50, 2, seed=5) == shards(50, 2, seed=5)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_epoch_advances_by_itself_after_a_full_pass(rank):
    sampler = TrainSampler(50, rank, 3, seed=SEED)
    first = list(sampler)  # no set_epoch at all
    second = list(sampler)
    third = list(sampler)
    assert first != second != third != first
    assert len(first) == len(second) == len(third) == sampler.num_samples

    # each automatic advance is exactly the next epoch
    for epoch, seen in enumerate((first, second, third)):
        fresh = TrainSampler(50, rank, 3, seed=SEED)
        fresh.set_epoch(epoch)
        assert list(fresh) == seen

    sampler.set_epoch(0)
    assert list(sampler) == first  # set_epoch(0) reproduces epoch 0
    assert list(sampler) == second


def test_textbook_set_epoch_each_epoch_still_works():
    sampler = TrainSampler(40, 1, 2, seed=SEED)
    expected = {epoch: shards(40, 2, epoch=epoch, seed=SEED)[1] for epoch in range(3)}
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert list(sampler) == expected[epoch]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_samples, world_size, rank", [(23, 3, 0), (23, 3, 2), (20, 4, 1), (5, 1, 0)])
def test_consumed_at_the_same_world_size_yields_the_tail_of_the_shard(num_samples, world_size, rank, drop_last):
    """The bitwise resume: after k samples of every rank's shard (k * world_size for the world), the rest."""
    epoch = 4
    full = shards(num_samples, world_size, epoch=epoch, seed=SEED, drop_last=drop_last)[rank]
    next_epoch = shards(num_samples, world_size, epoch=epoch + 1, seed=SEED, drop_last=drop_last)[rank]
    sampler = TrainSampler(num_samples, rank, world_size, seed=SEED, drop_last=drop_last)
    for start in range(len(full) + 1):
        if start * world_size > num_samples:  # only padding left: a run never stops there (drop_last loaders)
            break
        sampler.set_epoch(epoch, consumed=start * world_size)
        assert len(sampler) == len(full) - start
        assert list(sampler) == full[start:]
        # the skip applies to one pass only; the next pass is the whole next epoch
        assert len(sampler) == len(full)
        assert list(sampler) == next_epoch


@settings(max_examples=300, deadline=None)
@given(
    num_samples=st.integers(1, 200),
    old_world=st.integers(1, 8),
    new_world=st.integers(1, 8),
    batch=st.integers(1, 16),
    steps=st.integers(0, 30),
    drop_last=st.booleans(),
)
def test_another_world_size_continues_the_epoch_each_sample_once(
    num_samples, old_world, new_world, batch, steps, drop_last
):
    """Stopped after ``steps`` batches at one world size, continued at another: the epoch's samples are
    the permutation's, each seen once, plus the padding (at most new_world - 1 repeats) or minus the cut."""
    per_rank = num_samples // old_world if drop_last else -(-num_samples // old_world)
    steps = min(steps, per_rank // batch)
    consumed = min(steps * batch * old_world, num_samples)
    before = [
        index
        for rank in range(old_world)
        for index in shards(num_samples, old_world, epoch=2, seed=SEED, drop_last=drop_last)[rank][: steps * batch]
    ]
    after = []
    for rank in range(new_world):
        sampler = TrainSampler(num_samples, rank, new_world, seed=SEED, drop_last=drop_last)
        sampler.set_epoch(2, consumed=consumed)
        expected_length = len(sampler)
        part = list(sampler)
        assert len(part) == expected_length
        after.append(part)
    assert len({len(part) for part in after}) == 1  # every rank the same number of batches
    seen = Counter(before + [index for part in after for index in part])
    unique_before = len(set(before))
    rest = num_samples - consumed
    if drop_last:
        assert set(seen.values()) <= {1}
        assert len(seen) == unique_before + rest - rest % new_world  # the cut: fewer than new_world samples
    else:
        assert set(range(num_samples)) <= set(seen)  # nothing skipped
        assert sum(seen.values()) - len(seen) == sum(map(len, after)) - rest + (
            len(before) - unique_before
        )  # only padding repeats
        assert sum(map(len, after)) - rest < new_world


def test_set_epoch_consumed_out_of_range():
    sampler = TrainSampler(10, 0, 3)
    with pytest.raises(ValueError, match="consumed"):
        sampler.set_epoch(0, consumed=11)
    with pytest.raises(ValueError, match="consumed"):
        sampler.set_epoch(0, consumed=-1)


def test_dataloader_resume_mid_epoch_gives_the_remaining_batches():
    data = torch.arange(40)
    batch_size, epoch, world_size = 4, 1, 2
    sampler = TrainSampler(len(data), 0, world_size, seed=SEED)
    sampler.set_epoch(epoch)
    whole = [batch.tolist() for batch in DataLoader(data, batch_size=batch_size, sampler=sampler)]
    sampler.set_epoch(epoch, consumed=2 * batch_size * world_size)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    assert len(loader) == len(whole) - 2
    assert [batch.tolist() for batch in loader] == whole[2:]


# ---- evaluation ----


@pytest.mark.parametrize("num_samples, world_size", GRID)
def test_eval_sampler_covers_every_sample_exactly_once(num_samples, world_size):
    samplers = [EvalSampler(num_samples, rank, world_size) for rank in range(world_size)]
    parts = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [len(p) for p in parts]
    assert sorted(itertools.chain.from_iterable(parts)) == list(range(num_samples))
    for a, b in itertools.combinations(parts, 2):
        assert not set(a) & set(b)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == num_samples  # no padding
    for rank, part in enumerate(parts):
        assert part == list(range(rank, num_samples, world_size))  # r, r + W, r + 2W, ...


def test_eval_sampler_is_reiterable():
    sampler = EvalSampler(11, 1, 3)
    assert list(sampler) == list(sampler) == [1, 4, 7, 10]


def test_global_sum_count_without_process_group_returns_its_inputs():
    assert not dist.is_initialized()
    total, count = global_sum_count(2.5, 4)
    assert (total, count) == (2.5, 4)
    assert type(total) is float and type(count) is int

    value = torch.tensor(0.1, dtype=torch.float32)  # float32 -> float64 must not change the value
    total, count = global_sum_count(value, torch.tensor(3))
    assert total == float(value) and count == 3
    assert type(total) is float and type(count) is int

    big = 2**40 + 1  # exact in float64
    assert global_sum_count(float(big), big) == (float(big), big)
