"""The spawn harness itself: launch variables as torchrun sets them, results back in rank order, failures surface."""

from __future__ import annotations

import time

import pytest

from tests.distributed.harness import RankError, run_distributed
from tests.distributed.workers import agreed_error_on_every_rank, fail_on_rank_1, report_launch_env


def test_children_see_launch_variables_and_a_gloo_group(tmp_path):
    results = run_distributed(report_launch_env, 2, tmp_dir=tmp_path)
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, result in enumerate(results):
        env = result["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
            "127.0.0.1",
        )
        assert result["ctx"] == (rank, 2, "gloo", "cpu")
        assert result["group"] == (rank, 2, "gloo")


def test_an_exception_on_one_rank_fails_the_call_without_hanging(tmp_path):
    started = time.monotonic()
    with pytest.raises(RankError, match="boom on rank 1 of 2"):
        run_distributed(fail_on_rank_1, 2, tmp_dir=tmp_path)
    assert time.monotonic() - started < 30, "rank 0 was left waiting in its barrier"


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_agreed_error_keeps_every_rank_until_rank_0_has_said_it(tmp_path, world_size: int):
    """A rank that left first would make torchrun close rank 0, perhaps before its one line was out."""
    results = run_distributed(agreed_error_on_every_rank, world_size, tmp_dir=tmp_path)
    assert [r["code"] for r in results] == [2] * world_size
    assert results[0]["left_before_rank0"] is False
