"""Seeding and RNG state: round trips for python, numpy and torch, through a weights_only checkpoint."""

from __future__ import annotations

import io
import itertools
import random

import numpy as np
import pytest
import torch

from ddp_core.errors import ConfigError
from ddp_core.training.samplers import TrainSampler
from ddp_core.training.seed import (
    fit_seed,
    get_rng_state,
    rank_seed,
    seed_everything,
    seed_rank_streams,
    set_rng_state,
    worker_init_fn,
)
from experiments.toy import ToyModel


def python_draws():
    return [random.random() for _ in range(4)] + [random.gauss(0, 1), random.randrange(10**9)]


def numpy_draws():
    return np.concatenate([np.random.rand(4), np.random.normal(size=3), [np.random.normal()]])


def torch_draws():
    return torch.cat([torch.rand(4), torch.randn(3), torch.randint(0, 10**6, (2,)).float()])


def advance_everything():
    python_draws(), numpy_draws(), torch_draws()


@pytest.fixture
def mid_stream_state():
    """Generators moved away from a fresh seed, with gaussian caches (python and numpy) filled."""
    seed_everything(2024)
    advance_everything()
    random.gauss(0, 1)
    np.random.normal()
    return get_rng_state()


def test_python_round_trip(mid_stream_state):
    expected = python_draws()
    advance_everything()
    set_rng_state(mid_stream_state)
    assert python_draws() == expected


def test_numpy_round_trip(mid_stream_state):
    expected = numpy_draws()
    advance_everything()
    set_rng_state(mid_stream_state)
    assert np.array_equal(numpy_draws(), expected)


def test_torch_round_trip(mid_stream_state):
    expected = torch_draws()
    advance_everything()
    set_rng_state(mid_stream_state)
    assert torch.equal(torch_draws(), expected)


def test_each_generator_is_restored_independently(mid_stream_state):
    """Restoring must not depend on which generators were used in between."""
    expected = (python_draws(), numpy_draws(), torch_draws())
    torch_draws()  # only torch moves
    set_rng_state(mid_stream_state)
    actual = (python_draws(), numpy_draws(), torch_draws())
    assert actual[0] == expected[0]
    assert np.array_equal(actual[1], expected[1])
    assert torch.equal(actual[2], expected[2])


def test_state_survives_a_weights_only_checkpoint(mid_stream_state):
    expected = (python_draws(), numpy_draws(), torch_draws())
    buffer = io.BytesIO()
    torch.save({"rng": [mid_stream_state]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["rng"][0]
    seed_everything(7)
    advance_everything()
    set_rng_state(loaded)
    actual = (python_draws(), numpy_draws(), torch_draws())
    assert actual[0] == expected[0]
    assert np.array_equal(actual[1], expected[1])
    assert torch.equal(actual[2], expected[2])


def test_state_holds_no_numpy_objects(mid_stream_state):
    """numpy arrays or scalars in the state break weights_only loading (docs/design.md, "What a bitwise resume
    needs")."""

    def walk(value):
        if isinstance(value, dict):
            for item in value.values():
                yield from walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item)
        else:
            yield value

    leaves = list(walk(mid_stream_state))
    assert leaves
    assert not [leaf for leaf in leaves if type(leaf).__module__.startswith("numpy")]


def test_rank_seed_is_deterministic_and_distinct():
    seeds = {(seed, rank): rank_seed(seed, rank) for seed, rank in itertools.product(range(8), range(64))}
    assert len(set(seeds.values())) == len(seeds)  # no two (seed, rank) pairs collide
    assert rank_seed(1, 0) != rank_seed(0, 1)  # unlike seed + rank
    assert rank_seed(3, 5) == rank_seed(3, 5)
    for value in seeds.values():
        assert isinstance(value, int) and 0 <= value < 2**63  # valid for torch.manual_seed and random.seed


def test_rank_seed_differs_from_the_base_seed():
    # rank 0's stream after seed_rank_streams must not replay the model-init stream of seed_everything(seed)
    assert all(rank_seed(seed, 0) != seed for seed in range(100))


def test_seed_rank_streams_differ_across_ranks_and_repeat_per_rank():
    streams = {}
    for rank in range(4):
        seed_rank_streams(42, rank)
        streams[rank] = (torch.rand(4), np.random.rand(4), random.random())
    for a, b in itertools.combinations(range(4), 2):
        assert not torch.equal(streams[a][0], streams[b][0])
        assert not np.array_equal(streams[a][1], streams[b][1])
        assert streams[a][2] != streams[b][2]
    seed_rank_streams(42, 2)
    assert torch.equal(torch.rand(4), streams[2][0])


def test_seed_everything_gives_identical_model_init():
    seed_everything(17)
    first = ToyModel().state_dict()
    advance_everything()
    seed_everything(17)
    second = ToyModel().state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)

    seed_everything(18)
    other = ToyModel().state_dict()
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_seed_everything_seeds_all_three_generators():
    seed_everything(5)
    first = (random.random(), np.random.rand(), torch.rand(1))
    seed_everything(5)
    second = (random.random(), np.random.rand(), torch.rand(1))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    # and each matches a generator seeded independently with the same value
    assert first[0] == random.Random(5).random()
    assert first[1] == np.random.RandomState(5).rand()
    assert torch.equal(first[2], torch.rand(1, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("seed", [0, 2**32 - 1, 2**32 + 3, 2**63 - 1, 2**63, 2**64 - 1])
def test_seed_everything_accepts_every_seed_in_0_to_2_pow_64_minus_1(seed):
    seed_everything(seed)  # numpy's legacy RNG takes 32 bits: a larger seed is hashed into them
    assert np.random.rand() == np.random.RandomState(fit_seed(seed, 32)).rand()
    assert torch.initial_seed() == seed


def test_a_seed_that_fits_is_used_as_it_is_and_a_larger_one_is_hashed_not_wrapped():
    assert [fit_seed(s, 32) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]  # existing runs replay unchanged
    assert fit_seed(2**32 + 7, 32) != 7 and fit_seed(2**64 - 1, 63) != 2**63 - 1  # no seed % 2**bits collisions
    for seed in (2**32, 2**63, 2**64 - 1, 2**70):
        assert 0 <= fit_seed(seed, 32) < 2**32 and 0 <= fit_seed(seed, 63) < 2**63
    seed_everything(2**32 + 7)
    bigger = np.random.rand()
    seed_everything(7)
    assert np.random.rand() != bigger


@pytest.mark.parametrize("seed", [-1, -5, 2**64, 2**70, 1.5, True, "3"])
def test_seed_everything_refuses_seeds_outside_the_range_with_one_line(seed):
    with pytest.raises(ConfigError, match=r"seed=.* is out of range: it must be an integer in 0\.\.2\*\*64-1"):
        seed_everything(seed)


def test_the_sampler_takes_the_largest_seed_across_epochs():
    """torch seeds the sampler's generator with seed + epoch: 2**64-1 + 1 used to overflow at the second epoch."""
    sampler = TrainSampler(8, rank=0, world_size=1, seed=2**64 - 1)
    epochs = [list(sampler) for _ in range(3)]  # each pass advances the epoch
    assert all(sorted(order) == list(range(8)) for order in epochs)
    assert list(TrainSampler(8, 0, 1, seed=5)) == list(TrainSampler(8, 0, 1, seed=5))


def test_worker_init_fn_derives_numpy_and_python_from_torch_seed():
    torch.manual_seed(2**33 + 11)  # what torch does for a worker: base_seed + worker_id
    worker_init_fn(0)
    expected = (2**33 + 11) % 2**32
    assert np.random.rand() == np.random.RandomState(expected).rand()
    assert random.random() == random.Random(expected).random()


class _WorkerDraws(torch.utils.data.Dataset):
    """Each item reports what the worker that loaded it draws from torch, numpy and python."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        import random as py_random

        import numpy

        return index, torch.rand(1).item(), float(numpy.random.rand()), py_random.random()


def _draws(seed: int, rank: int) -> list[tuple[float, float, float]]:
    from ddp_core.training.seed import loader_generator, worker_init_fn

    loader = torch.utils.data.DataLoader(
        _WorkerDraws(),
        batch_size=None,
        num_workers=2,
        worker_init_fn=worker_init_fn,
        generator=loader_generator(seed, rank),
    )
    return [tuple(item[1:]) for item in loader]


def test_dataloader_workers_differ_per_rank_and_per_worker_and_repeat():
    rank0, rank1 = _draws(0, 0), _draws(0, 1)
    assert _draws(0, 0) == rank0  # reproducible
    # items 0 and 1 come from workers 0 and 1: every (rank, worker) pair draws differently, in every library
    firsts = [rank0[0], rank0[1], rank1[0], rank1[1]]
    for library in range(3):
        assert len({draw[library] for draw in firsts}) == 4, firsts


class FakeCuda:
    """torch.cuda's RNG functions on a pretend machine of ``gpus`` GPUs; every call is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, current: int, gpus: int = 8, initialized: bool = True):
        self.current, self.calls = current, []
        self.states = {
            i: torch.full((16,), i, dtype=torch.uint8) for i in range(gpus)
        }  # one recognisable state per GPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)
        for name in (
            "get_rng_state_all",
            "set_rng_state_all",
        ):  # every visible GPU: what a rank must not save or restore
            monkeypatch.setattr(torch.cuda, name, lambda *args, name=name: pytest.fail(f"torch.cuda.{name} was called"))

    def get_rng_state(self, device):
        self.calls.append(("get", device))
        return self.states[device].clone()

    def set_rng_state(self, state, device):
        self.calls.append(("set", device, int(state[0])))


@pytest.mark.parametrize(("initialized", "saved"), [(True, True), (False, False)])
def test_only_this_ranks_current_gpu_state_is_saved(monkeypatch, initialized, saved):
    cuda = FakeCuda(monkeypatch, current=3, initialized=initialized)
    state = get_rng_state()
    assert ("cuda" in state) == saved  # CUDA never used in this process: nothing to save, and no CUDA init for it
    if saved:
        assert cuda.calls == [("get", 3)]
        assert torch.equal(state["cuda"], cuda.states[3])


def test_the_cuda_state_survives_a_weights_only_checkpoint(monkeypatch):
    FakeCuda(monkeypatch, current=2)
    buffer = io.BytesIO()
    torch.save({"rng": [get_rng_state()]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["rng"][0]
    assert loaded["cuda"].dtype == torch.uint8 and int(loaded["cuda"][0]) == 2


def test_a_rank_resumed_on_another_gpu_gets_its_own_stream_there(monkeypatch):
    """2 ranks on cuda:0 and cuda:1 of one node, resumed as 2 nodes of 1 GPU: both are cuda:0 now."""
    saved = []
    for rank in range(2):
        FakeCuda(monkeypatch, current=rank)
        saved.append(get_rng_state())
    for rank in range(2):
        cuda = FakeCuda(monkeypatch, current=0, gpus=1)
        set_rng_state(saved[rank])
        assert cuda.calls == [("set", 0, rank)], f"rank {rank}"  # its own stream, not device 0's of the old layout


def test_no_cuda_state_is_restored_without_cuda(monkeypatch):
    """A GPU checkpoint resumed with BACKEND=gloo: the CPU streams are restored, the GPU's is ignored."""
    state = get_rng_state()
    state["cuda"] = torch.zeros(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *args: pytest.fail("set a CUDA RNG state without CUDA"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), state["torch"])
