"""Exact evaluation: EvalSampler + global_sum_count count every sample once; DistributedSampler pads."""

from __future__ import annotations

import math

from tests.distributed.harness import section
from tests.distributed.workers import SAMPLER_SIZES

# (world size, N): sum of v_i = i**2 over i < N is N(N-1)(2N-1)/6
EXACT = {2: (91.0, 7), 3: (285.0, 10)}
# DistributedSampler(drop_last=False) pads every rank to ceil(N/W) samples by repeating the first indices:
# N=10, W=3 -> 12 samples, 0 and 1 twice (285 + 0 + 1); N=7, W=2 -> 8 samples, 0 twice (91 + 0)
PADDED = {2: (91.0, 8), 3: (286.0, 12)}


def test_closed_forms():
    for world_size, (total, n) in EXACT.items():
        assert SAMPLER_SIZES[world_size] == n
        assert total == n * (n - 1) * (2 * n - 1) / 6 == sum(i * i for i in range(n))
        assert PADDED[world_size][1] == math.ceil(n / world_size) * world_size


def test_eval_sampler_shards_without_padding(world_runs, world_size):
    n = SAMPLER_SIZES[world_size]
    per_rank = section(world_runs[world_size], "samplers")
    for rank, out in enumerate(per_rank):
        assert out["n"] == n
        assert out["eval_len"] == math.ceil((n - rank) / world_size) == len(range(rank, n, world_size))
        shards = out["eval_indices"]
        assert shards == [list(range(r, n, world_size)) for r in range(world_size)]
        assert sorted(i for shard in shards for i in shard) == list(range(n))  # each sample exactly once
        local_sum, local_count = out["eval_local"]
        assert (local_sum, local_count) == (
            float(sum(i * i for i in range(rank, n, world_size))),
            len(range(rank, n, world_size)),
        )


def test_global_sum_count_is_exact_on_every_rank(world_runs, world_size):
    for rank, out in enumerate(section(world_runs[world_size], "samplers")):
        total, count = out["eval_global"]
        assert (total, count) == EXACT[world_size], f"rank {rank}"
        assert isinstance(count, int)


def test_distributed_sampler_would_count_padded_duplicates(world_runs, world_size):
    for rank, out in enumerate(section(world_runs[world_size], "samplers")):
        assert out["padded_global"] == PADDED[world_size], f"rank {rank}"
        assert out["padded_global"][1] != EXACT[world_size][1]
