"""CIFAR10 pieces that need a real process group: one download for all ranks, SyncBN conversion."""

from __future__ import annotations

from tests.distributed.cifar10_workers import download_then_build
from tests.distributed.harness import run_distributed


def test_one_rank_downloads_and_every_rank_loads_the_data(tmp_path):
    data_dir, calls = tmp_path / "data", tmp_path / "calls"
    calls.mkdir()
    results = run_distributed(download_then_build, 3, str(data_dir), str(calls), tmp_dir=tmp_path / "results")
    assert (
        len(list(calls.iterdir())) == 1
    )  # asked twice by each of 3 ranks, downloaded once (whichever took the lock first)
    for per_rank in results:
        assert per_rank["sync_bn=True"]["train"] == 40 and per_rank["sync_bn=True"]["test"] == 11
        assert per_rank["sync_bn=True"]["bn"] == ["GlobalBatchNorm"]  # every BatchNorm synchronised on CPU
        assert per_rank["sync_bn=False"]["bn"] == ["BatchNorm2d"]  # --no-sync-bn: per-rank statistics
