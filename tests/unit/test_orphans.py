"""ddp_core.process.orphans: the kernel's request is in place, and a parent that died before it is noticed.

Each case runs in a process of its own: the request outlives the call, and the second case kills its process.
The launchers themselves are tested killed for real in tests/e2e/test_launch_paths.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ddp_core.process.orphans import LAUNCHER_PID_VARIABLE, SUPPORTED

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


@pytest.mark.parametrize(
    ("launcher", "killed"),
    [
        ("os.getppid()", False),  # started by the launcher: the request, as above
        ("os.getpid()", False),  # another parent (a fork server) while the launcher lives: left alone
        ("2**22 + 1", True),  # a launcher that is gone (no such pid): nothing would ever send the signal
        ("", False),  # not under ddp_core.torchrun
    ],
)
def test_a_worker_under_the_launcher_asks_as_it_enters_ddp_lab(launcher, killed):
    code = f"""
import ctypes, os
if {launcher!r}:
    os.environ[{LAUNCHER_PID_VARIABLE!r}] = str(eval({launcher!r}))
from ddp_core.process.orphans import die_with_launcher
die_with_launcher()
signal = ctypes.c_int(0)
ctypes.CDLL(None).prctl({PR_GET_PDEATHSIG}, ctypes.byref(signal), 0, 0, 0)
print(signal.value, {LAUNCHER_PID_VARIABLE!r} in os.environ)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if killed:
        assert result.returncode == -signal.SIGKILL and result.stdout == "", (result.returncode, result.stderr)
    else:
        assert result.returncode == 0, result.stderr
        expected = signal.SIGKILL if launcher == "os.getppid()" else 0
        assert result.stdout.split() == [str(expected), "False"]
