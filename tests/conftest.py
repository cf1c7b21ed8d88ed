"""Every test not marked ``gpu`` runs as on a machine without GPUs, so the suite passes on a GPU box too.

Without this, on a GPU box BACKEND=auto picks nccl: a 3- or 4-process test on one GPU fails ("only 1
GPU(s) visible"), and tests written for the CPU path see CUDA. Hidden for such a test:

- ``CUDA_VISIBLE_DEVICES=""``: reaches torchrun's workers and ``mp.spawn``'s children (os.environ is
  copied when a process starts), whose CUDA then finds no device; ddp_core.distributed.cuda takes an empty list as
  "CPU on purpose", so a visible driver is not reported as unusable;
- ``torch.cuda.is_available`` -> False and ``torch.cuda.device_count`` -> 0 in this process, whose
  CUDA runtime may already have read the real list (tests/gpu's skip condition reads it at collection).

Hiding the GPUs is a hook, not an autouse fixture: a module- or session-scoped fixture (the e2e runs, the spawned
gloo worlds) is set up before any function-scoped fixture, and would launch its processes with the GPUs
still visible. ``pytest_runtest_setup`` runs before every fixture of the test. A test's own
``monkeypatch.setattr(torch.cuda, ...)`` comes later and wins; it is undone first, this last.
Tests marked ``gpu`` (tests/gpu) see the real GPUs.

Every test, ``gpu`` or not, also runs without what a user's or a cluster's shell commonly exports: the
launcher's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), ddp-lab's own (``SEED``, ``BACKEND``,
``DDP_LAB_*``), thread counts (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) and torch's (``TORCH_*``, but
``TORCH_HOME``): a test that depends on one sets it (``monkeypatch.setenv``, ``tests.e2e.launch.clean_env``).
Cleared in the same hook, for the same reason: before any fixture launches a process.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest
import torch

from tests.e2e.launch import LAUNCH_VARIABLES

_HIDDEN = pytest.StashKey[pytest.MonkeyPatch]()


def hide_gpus(patch: pytest.MonkeyPatch) -> None:
    """Make this process and every process it starts see no GPU."""
    patch.setenv("CUDA_VISIBLE_DEVICES", "")
    patch.setattr(torch.cuda, "is_available", lambda: False)
    patch.setattr(torch.cuda, "device_count", lambda: 0)


_CLEARED = frozenset({*LAUNCH_VARIABLES, "OMP_NUM_THREADS", "MKL_NUM_THREADS"})
_CLEARED_PREFIXES = ("TORCH_", "TORCHELASTIC_", "DDP_LAB_")
_KEPT = frozenset({"TORCH_HOME"})  # where torch keeps its downloads: a cache, no behaviour


def clear_the_callers_environment(patch: pytest.MonkeyPatch) -> None:
    """Unset what the shell that runs the suite may export and a test must not depend on."""
    for name in list(os.environ):
        if name in _CLEARED or (name.startswith(_CLEARED_PREFIXES) and name not in _KEPT):
            patch.delenv(name)
    # torch read TORCH_DISTRIBUTED_DEBUG when this process imported it (DETAIL wraps every process group, and a
    # world of one in DDP then crashed): read again, unset, so this process's groups are as a plain shell's
    torch.distributed.set_debug_level_from_env()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    patch = pytest.MonkeyPatch()
    item.stash[_HIDDEN] = patch
    clear_the_callers_environment(patch)
    if item.get_closest_marker("gpu") is None:
        hide_gpus(patch)
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)  # the test's own fixtures are torn down in here, with the GPUs still hidden
    finally:
        patch = item.stash.get(_HIDDEN, None)
        if patch is not None:
            patch.undo()


# The test modules that take longest (seconds of one of two workers, from a run of `make test`'s first part with
# --junitxml on the 2-core machine, 2026-11-27: 1,280 s of tests in 658 s; docs/benchmarks.md, "Test suite time
# without Docker and Slurm"), longest first. `make test` runs each module whole on one pytest-xdist worker
# (--dist loadscope) and hands the modules out in collection order (--no-loadscope-reorder): these start first,
# and the many short modules fill the workers' ends, so that no worker is left running a long module alone at the
# end. Only the order depends on this list, and only the suite's speed on the order; a module not listed runs
# after these, in pytest's own order.
LONGEST_FIRST = [
    "tests/e2e/test_resume_world_sizes.py",  # 137 s
    "tests/e2e/test_cifar10.py",  # 90 s
    "tests/e2e/test_bench_recovery.py",  # 22 s alone, 65 s on the loaded machine: three toy runs
    "tests/e2e/test_comm_knobs.py",  # 83 s
    "tests/e2e/test_faults.py",  # 82 s
    "tests/e2e/test_launch_paths.py",  # 81 s
    "tests/e2e/test_contract_domains.py",  # 72 s
    "tests/e2e/test_cifar10_amp.py",  # 56 s
    "tests/e2e/test_step_overhead.py",  # 51 s
    "tests/e2e/test_hang_stacks.py",  # about 50 s measured alone, most of it two DIST_TIMEOUT_S waits
    "tests/e2e/test_launch.py",  # 46 s
    "tests/distributed/test_sync_batchnorm.py",  # 45 s
    "tests/e2e/test_fault_reports.py",  # 45 s
    "tests/e2e/test_contract.py",  # 40 s
    "tests/unit/test_writer_process.py",  # 35 s
    "tests/e2e/test_preflight.py",  # 32 s
    "tests/e2e/test_charlm.py",  # 30 s
    "tests/e2e/test_printed_once.py",  # 28 s
    "tests/e2e/test_resume_checks.py",  # 19 s
    "tests/e2e/test_checkpoints.py",  # 17 s
    "tests/e2e/test_new_experiment.py",  # 15 s
    "tests/e2e/test_divergence.py",  # 15 s
    "tests/unit/test_prefork.py",  # 14 s
    "tests/e2e/test_study.py",  # 14 s
    "tests/e2e/test_toy.py",  # 13 s
    "tests/e2e/test_tracked_state.py",  # 11 s
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    place = {module: index for index, module in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: place.get(item.nodeid.split("::")[0], len(place))
    )  # stable: each module's own order stays
