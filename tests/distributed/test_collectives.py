"""Every helper in ddp_core/distributed/collectives.py on real 2- and 3-rank gloo groups, against
closed-form results."""

from __future__ import annotations

import torch

from tests.distributed.harness import section
from tests.distributed.workers import (
    TENSOR_SHAPES,
    gather_row,
    print_block_body,
    rank_object,
    same_shape_list,
    tensor_list,
    varsize_rows,
)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected)


def test_all_gather_tensors_returns_every_ranks_list_of_different_shapes(world_runs, world_size):
    for rank, out in enumerate(section(world_runs[world_size], "collectives")):
        result = out["all_gather_tensors"]
        assert len(result) == world_size, f"rank {rank}"
        for r in range(world_size):
            assert len(result[r]) == len(TENSOR_SHAPES)
            for i, shape in enumerate(TENSOR_SHAPES):
                expected = (r * 1000 + i * 100 + torch.arange(torch.Size(shape).numel(), dtype=torch.float32)).reshape(
                    shape
                )
                assert _same(result[r][i], expected), f"on rank {rank}: result[{r}][{i}] = {result[r][i]}"
                assert _same(result[r][i], tensor_list(r)[i])


def test_all_gather_tensors_uses_one_collective_for_five_tensors(world_runs, world_size):
    for rank, out in enumerate(section(world_runs[world_size], "collectives")):
        counts = out["all_gather_tensors_calls"]
        assert len(TENSOR_SHAPES) == 5
        assert counts["all_gather"] == 1, f"rank {rank}: {counts}"
        assert sum(counts.values()) == 1, f"rank {rank}: other collectives were called too: {counts}"


def test_all_gather_tensors_of_one_shape_in_one_collective(world_runs, world_size):
    """The stacked fast path: same result layout, one all_gather."""
    for rank, out in enumerate(section(world_runs[world_size], "collectives")):
        result, counts = out["all_gather_same_shape"], out["all_gather_same_shape_calls"]
        assert [len(per_rank) for per_rank in result] == [6] * world_size, f"rank {rank}"
        for r in range(world_size):
            assert all(_same(got, expected) for got, expected in zip(result[r], same_shape_list(r))), (
                f"rank {rank}: result[{r}]"
            )
        assert counts["all_gather"] == 1 and sum(counts.values()) == 1, f"rank {rank}: {counts}"


def test_all_gather_varsize_rank_r_contributes_r_plus_1_rows(world_runs, world_size):
    for rank, out in enumerate(section(world_runs[world_size], "collectives")):
        result = out["all_gather_varsize"]
        assert len(result) == world_size
        for r in range(world_size):
            expected = (r * 100 + torch.arange((r + 1) * 3, dtype=torch.float32)).reshape(r + 1, 3)
            assert _same(result[r], expected), f"on rank {rank}: slot {r} = {result[r]}"
            assert _same(result[r], varsize_rows(r))


def test_gather_tensors_to_first_and_last_rank(world_runs, world_size):
    per_rank = section(world_runs[world_size], "collectives")
    for dst in {0, world_size - 1}:
        for rank, out in enumerate(per_rank):
            got = out["gather_tensors"][dst]
            if rank == dst:
                assert got is not None and len(got) == world_size
                for r in range(world_size):
                    assert _same(got[r], torch.tensor([r, r * r, 7 * r + 1], dtype=torch.float32)), (
                        f"dst {dst}: slot {r} = {got[r]}"
                    )
                    assert _same(got[r], gather_row(r))
            else:
                assert got is None, f"rank {rank} is not dst={dst} but received {got}"


def test_all_gather_object(world_runs, world_size):
    expected = [rank_object(r) for r in range(world_size)]
    assert expected[1] == {"rank": 1, "name": "rr", "items": [0], "nested": (1, {"sq": 1})}
    for rank, out in enumerate(section(world_runs[world_size], "collectives")):
        assert out["all_gather_object"] == expected, f"rank {rank}"


def test_gather_object_to_first_and_last_rank(world_runs, world_size):
    expected = [rank_object(r) for r in range(world_size)]
    per_rank = section(world_runs[world_size], "collectives")
    for dst in {0, world_size - 1}:
        for rank, out in enumerate(per_rank):
            assert out["gather_object"][dst] == (expected if rank == dst else None), f"dst {dst}, rank {rank}"


def test_broadcast_object_from_first_and_last_rank(world_runs, world_size):
    per_rank = section(world_runs[world_size], "collectives")
    for src in {0, world_size - 1}:
        for rank, out in enumerate(per_rank):
            assert out["broadcast_object"][src] == rank_object(src), f"src {src}, rank {rank}"


def test_print_in_rank_order_prints_blocks_in_rank_order_on_rank_0_only(world_runs, world_size):
    per_rank = section(world_runs[world_size], "collectives")
    blocks = [f"Rank {r}: hello\n{print_block_body(r)}" for r in range(world_size)]
    assert blocks[1] == "Rank 1: hello\n{'rank': 1, 'cube': 1}"
    text = per_rank[0]["print_in_rank_order"]
    assert text == "\n\n".join(blocks) + "\n\n"  # print's own newline after the trailing "\n"
    positions = [text.index(f"Rank {r}: ") for r in range(world_size)]
    assert positions == sorted(positions)
    assert (
        per_rank[0]["print_in_rank_order_no_body"]
        == "\n\n".join(f"Rank {r}: title only {r}" for r in range(world_size)) + "\n\n"
    )
    for rank in range(1, world_size):
        assert per_rank[rank]["print_in_rank_order"] == "", f"rank {rank} printed"
        assert per_rank[rank]["print_in_rank_order_no_body"] == "", f"rank {rank} printed"


def test_the_group_is_still_whole_after_every_check(world_runs, world_size):
    for rank, after in enumerate(section(world_runs[world_size], "after")):
        assert after == {"rank": rank, "world_size": world_size}
