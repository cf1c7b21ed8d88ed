"""bench.ddp picks its backend so that `make bench` runs on any host (it once aborted on one GPU)."""

from __future__ import annotations

import pytest

from bench.ddp import choose_backend


@pytest.mark.parametrize(
    ("processes", "gpus", "expected"),
    [(2, 0, "gloo"), (2, 1, "gloo"), (2, 2, "nccl"), (2, 8, "nccl"), (4, 2, "gloo"), (1, 1, "nccl")],
)
def test_auto_is_nccl_only_with_a_gpu_per_process(processes, gpus, expected):
    assert choose_backend("auto", processes, gpus) == expected


def test_an_explicit_backend_is_kept():
    assert choose_backend("gloo", 2, 8) == "gloo"
    assert choose_backend("nccl", 2, 1) == "nccl"  # and the process group refuses it with one line, exit 2
