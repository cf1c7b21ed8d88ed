"""rank0_decides on real 2- and 3-rank gloo groups: rank 0 alone runs the work, and every rank returns its result
or raises the same error, the way each kind of failure is meant to be seen."""

from __future__ import annotations

import torch

from tests.distributed.harness import section


def test_every_rank_returns_rank_0s_result_and_only_rank_0_ran_the_work(world_runs, world_size):
    outs = section(world_runs[world_size], "agreement")
    for rank, out in enumerate(outs):
        returned = out["value"]["returned"]
        assert returned["rank"] == 0 and torch.equal(returned["tensor"], torch.arange(3)), f"rank {rank}"
        assert out["ran_on"] == ([0] if rank == 0 else []), f"rank {rank}"
        assert out["after"] == {"returned": "still in step"}


def test_a_config_error_or_a_storage_error_is_raised_on_every_rank_with_rank_0s_line(world_runs, world_size):
    for rank, out in enumerate(section(world_runs[world_size], "agreement")):
        # agreed: printed once, by rank 0 (exits_with_one_line), however many ranks raise it
        assert out["config"] == {"type": "ConfigError", "message": "refused by rank 0", "agreed": True}, f"rank {rank}"
        assert out["storage"]["type"] == "StorageError" and out["storage"]["message"] == "disk full on rank 0"


def test_a_bug_on_rank_0_keeps_its_own_error_there_and_fails_the_others_at_once(world_runs, world_size):
    outs = section(world_runs[world_size], "agreement")
    assert outs[0]["bug"] == {"type": "ZeroDivisionError", "own": True, "message": "division by zero"}
    for rank, out in enumerate(outs[1:], start=1):
        assert out["bug"]["type"] == "RankZeroFailed", f"rank {rank}"
        assert "ZeroDivisionError: division by zero" in out["bug"]["message"]
