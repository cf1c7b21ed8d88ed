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
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch

_HIDDEN = pytest.StashKey[pytest.MonkeyPatch]()


def hide_gpus(patch: pytest.MonkeyPatch) -> None:
    """Make this process and every process it starts see no GPU."""
    patch.setenv("CUDA_VISIBLE_DEVICES", "")
    patch.setattr(torch.cuda, "is_available", lambda: False)
    patch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if item.get_closest_marker("gpu") is None:
        patch = pytest.MonkeyPatch()
        item.stash[_HIDDEN] = patch
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
