"""ddp_core.process.orphans: the kernel's request is in place, and a parent that died before it is noticed.

Each case runs in a process of its own: the request outlives the call, and the second case kills its process.
The launchers themselves are tested killed for real in tests/e2e/test_launch_paths.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ddp_core.process.orphans import SUPPORTED

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="PR_SET_PDEATHSIG is Linux's")

PR_GET_PDEATHSIG = 2  # <linux/prctl.h>
READ_BACK = f"""
import ctypes, os
from ddp_core.process.orphans import die_with_parent
die_with_parent({{parent}})
signal = ctypes.c_int(0)
ctypes.CDLL(None).prctl({PR_GET_PDEATHSIG}, ctypes.byref(signal), 0, 0, 0)
print(signal.value)
"""


def test_a_worker_whose_parent_lives_asks_for_sigkill_when_it_dies():
    result = subprocess.run(
        [sys.executable, "-c", READ_BACK.format(parent="os.getppid()")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == signal.SIGKILL


def test_a_worker_whose_parent_died_before_the_request_kills_itself():
    """Its parent pid is not the launcher's any more (it was adopted): no signal would ever come."""
    result = subprocess.run(
        [sys.executable, "-c", READ_BACK.format(parent="os.getppid() + 1")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -signal.SIGKILL and result.stdout == "", (result.returncode, result.stderr)
