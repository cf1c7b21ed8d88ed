"""tests/conftest.py: a test not marked gpu sees no GPU (nor do its fixtures' and its own child processes); a gpu
test does.

Checked in a separate pytest session (the outer one has already hidden the GPUs from this test) whose
CUDA_VISIBLE_DEVICES names a GPU, so "hidden" and "left alone" are told apart on any machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

PROBES = """
import os, subprocess, sys
import pytest
import torch

REAL_IS_AVAILABLE, REAL_DEVICE_COUNT = torch.cuda.is_available, torch.cuda.device_count  # at collection: never hidden

def child_sees():
    code = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

@pytest.fixture(scope="module")
def module_fixture_sees():
    return os.environ.get("CUDA_VISIBLE_DEVICES"), child_sees()  # set up before any function-scoped fixture

def test_unmarked(module_fixture_sees):
    assert module_fixture_sees == ("", "''")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and child_sees() == "''"
    assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0

def test_own_monkeypatch_wins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch.cuda.is_available() is True

@pytest.mark.gpu
def test_marked():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and child_sees() == "'0'"
    assert torch.cuda.is_available is REAL_IS_AVAILABLE and torch.cuda.device_count is REAL_DEVICE_COUNT

def test_after_all():
    assert torch.cuda.is_available() is False  # hidden again, and the previous test's patch was undone
"""


def test_only_tests_marked_gpu_see_the_gpus(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_probes.py").write_text(PROBES)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    # the copied conftest imports the project's test helpers (tests.e2e.launch): the repository on the path
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": str(CONFTEST.parents[1])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probes.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout, result.stdout
    # and in this (outer) session, this unmarked test is hidden too
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
