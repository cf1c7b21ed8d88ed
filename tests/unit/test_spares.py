"""Warm spares (ddp_core/process/spares.py): which worker a warm parent may fork, and the worker it forks, seen from
the launcher as torchrun sees a worker (its pid, poll, wait, signals to its session). The parent runs for real,
started with tests.prefork's interpreter (torch imported already); the worker is tests/unit/prefork_probe.py. A
whole restarted run is bench.recovery --warm-spares's (it ends bitwise-equal to the run without faults)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import pytest

from ddp_core.process.spares import Spares
from tests import prefork
from tests.e2e.launch import clean_env

PROBE = "tests.unit.prefork_probe"


@pytest.fixture
def spares(tmp_path):
    """A warm parent for the probe, its output (and its workers') in a file; stopped after the test."""
    out = (tmp_path / "out").open("w")
    spares = Spares()
    spares.start(prefork.python(), PROBE, 3, partial(subprocess.Popen, stdout=out, stderr=out))
    yield spares
    spares.stop()
    out.close()


def worker(spares: Spares, how: str):
    forked = spares.take([prefork.python(), "-u", "-m", PROBE, how], clean_env(PROBE="the order's"))
    assert forked is not None
    return forked


def lines(tmp_path: Path) -> list[str]:
    return (tmp_path / "out").read_text().splitlines()


def test_a_forked_worker_runs_the_module_with_the_orders_arguments_and_environment(spares, tmp_path):
    shown = worker(spares, "show")
    assert shown.wait(timeout=60) == 0 and shown.returncode == 0
    seen = json.loads(lines(tmp_path)[0])
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["show"] and seen["argv"][0].endswith("prefork_probe.py")
    assert seen["probe"] == "the order's"  # the order's environment, not the parent's
    assert lines(tmp_path)[1] == "atexit ran"  # the interpreter's own exit
    assert worker(spares, "exit3").wait(timeout=60) == 3
    assert worker(spares, "sigkill-self").wait(timeout=60) == -signal.SIGKILL


def test_a_forked_worker_takes_signals_to_its_session_and_dies_with_its_parent(spares, tmp_path):
    stopped, waiting = worker(spares, "wait-for-sigterm"), worker(spares, "wait-for-sigterm")
    assert stopped.pid != waiting.pid and stopped.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        stopped.wait(timeout=0.2)
    deadline = time.monotonic() + 60
    while sum(line.startswith("waiting") for line in lines(tmp_path)) < 2 and time.monotonic() < deadline:
        stopped.parent.collect(0.1)  # until both have set their handler (they print it)
    assert os.getsid(stopped.pid) == stopped.pid  # a session of its own, as torchrun starts its workers
    assert stopped.parent.process.args[-1] == PROBE  # ps names the module on the parent's command line, the workers
    os.killpg(stopped.pid, signal.SIGTERM)  # what torchrun does to close a worker
    assert stopped.wait(timeout=60) == 7
    spares.stop()  # the job's end: the parent is killed, and the kernel kills its worker
    assert waiting.poll() == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(waiting.pid):
        time.sleep(0.05)  # polling the process table: nothing else says when the kernel's kill has landed
    assert not _alive(waiting.pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def exits_at_once(args: list[str], **kwargs: object) -> subprocess.Popen:
    """A warm parent that ends before it connects."""
    return subprocess.Popen([sys.executable, "-c", "pass"], **kwargs)


def test_no_worker_for_another_command_redirected_output_or_a_parent_that_died():
    spares = Spares()
    spares.start(sys.executable, PROBE, 1, exits_at_once)
    parent = spares.parents[(sys.executable, PROBE)]
    try:
        assert spares.take([sys.executable, "-u", "-m", "experiments.toy"], {}) is None  # another module
        assert spares.take([sys.executable, "-u", "probe.py"], {}) is None  # a script, not -m
        assert spares.take([sys.executable, "-u", "-m", PROBE], {}, stdout="/tmp/log") is None  # --redirects
        parent.process.wait()  # the parent exited before connecting: the worker is started as usual
        assert spares.take([sys.executable, "-u", "-m", PROBE], {}) is None
        spares.start(sys.executable, PROBE, 1, exits_at_once)
        assert spares.parents[(sys.executable, PROBE)] is not parent  # a dead parent is replaced at the next start
    finally:
        spares.stop()


def test_a_temp_folder_too_long_for_a_socket_name_is_not_used(tmp_path, monkeypatch):
    """A cluster's TMPDIR can be long; a socket's path has at most 107 bytes: the parent's socket goes to /tmp."""
    python = prefork.python()  # the suite's own server first: its socket is in the temp folder too
    long = tmp_path / ("t" * 120)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    out = (tmp_path / "out").open("w")
    spares = Spares()
    try:
        spares.start(python, PROBE, 1, partial(subprocess.Popen, stdout=out, stderr=out))
        assert worker(spares, "exit3").wait(timeout=60) == 3
        assert not list(long.iterdir())
    finally:
        spares.stop()
        out.close()
