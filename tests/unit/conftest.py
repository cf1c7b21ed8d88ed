"""Shared fixtures for the unit tests: no process group, no leaked environment variables."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.processes import option_variables
from ddp_core.config import CommonArgs
from ddp_core.distributed.env import TORCHRUN_VARIABLES

# Every variable ddp_core reads. A test (or a .env file that python-dotenv loads into os.environ)
# may set any of them; each is registered with monkeypatch first, so it is restored afterwards.
DDP_VARIABLES = (*TORCHRUN_VARIABLES, *option_variables(CommonArgs), "STEPS", "BATCH_SIZE", "LR")


def _forget(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # monkeypatch.delenv records nothing for a variable that is absent, so a later os.environ[name] = ...
    # (python-dotenv) would leak. setenv first records the original state; delenv then removes it.
    monkeypatch.setenv(name, "placeholder")
    monkeypatch.delenv(name)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> pytest.MonkeyPatch:
    """No ddp-lab variable in os.environ, the working directory an empty temp dir; all undone afterwards."""
    for name in DDP_VARIABLES:
        _forget(monkeypatch, name)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


@pytest.fixture(autouse=True)
def no_process_group():
    """Unit tests run without torch.distributed; fail loudly if one leaks in or out."""
    assert not dist.is_initialized(), "a process group exists before a unit test"
    yield
    assert not dist.is_initialized(), "a unit test left a process group behind"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: one intra-op thread is as fast, and immune to the 8 ms stalls a busy 2-core machine
    gives a 2-thread op whose second thread is descheduled."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
