"""A restarted worker forked from the warm parent (ddp_core/process/warm.py) looks from outside as a cold one does.

One warm parent (a real interpreter, torch imported) for the module; each case starts the thin client as torchrun
would in a restarted group (``TORCHELASTIC_RESTART_COUNT=1``), running tests/unit/prefork_probe.py, and compares
with ``python -m`` itself: output and exit status, then what only the pair client + child must do: forward a
signal, take the other with it when one is SIGKILLed, show the real command in ``ps``, and start cold when asked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_core.process import warm
from tests.e2e.launch import REPO, clean_env

PROBE = "tests.unit.prefork_probe"
GONE_WITHIN_S = 30


@pytest.fixture(scope="module")
def socket_path() -> Iterator[str]:
    stop = warm.start()
    path = os.environ.pop(warm.SOCKET_VARIABLE)
    yield path
    os.environ[warm.SOCKET_VARIABLE] = path
    stop()


def client(socket_path: str, how: str, restart: str = "1", **env: str) -> subprocess.Popen:
    """A worker of a restarted group (``restart``: its TORCHELASTIC_RESTART_COUNT) running the probe."""
    return subprocess.Popen(
        [sys.executable, "-u", "-m", warm.__name__, "-u", "-m", PROBE, how],
        cwd=REPO,
        env=clean_env(PROBE="set", TORCHELASTIC_RESTART_COUNT=restart, **{warm.SOCKET_VARIABLE: socket_path}, **env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cold(how: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-u", "-m", PROBE, how]
    return subprocess.run(command, cwd=REPO, env=clean_env(PROBE="set"), capture_output=True, text=True, timeout=60)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def waiting(process: subprocess.Popen) -> int:
    """The pid of the probe that ``process`` started, once it waits for a signal (its first lines say so)."""
    for line in process.stdout:
        if line.startswith("waiting "):
            return int(line.split()[1])
    raise AssertionError(f"the probe ended first: {process.wait()} {process.stderr.read()}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for a condition: the kernel's kill to take effect
    return not alive(pid)


@pytest.mark.parametrize("how", ["show", "exit3", "exit-message", "raise", "interrupt", "thread", "sigkill-self"])
def test_a_warm_worker_ends_and_prints_as_python_m_does(socket_path: str, how: str):
    expected = cold(how)
    process = client(socket_path, how)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out) == (expected.returncode, expected.stdout), err
    assert err.strip().splitlines()[-1:] == expected.stderr.strip().splitlines()[-1:]


def test_a_warm_worker_is_the_parents_child_shows_its_command_and_gets_the_clients_signals(socket_path: str):
    process = client(socket_path, "wait-for-sigterm")
    try:
        worker = waiting(process)
        assert worker != process.pid and "-m ddp_core.process.warm" in command_line(parent_of(worker))
        assert command_line(worker) == f"{sys.executable} -u -m {PROBE} wait-for-sigterm"  # its title in ps
        process.send_signal(signal.SIGTERM)  # as torchrun stops a worker: the probe exits 7 on SIGTERM
        assert process.wait(timeout=60) == 7
    finally:
        process.kill()


def test_a_sigkill_of_either_takes_the_other(socket_path: str):
    clients = [client(socket_path, "wait-for-sigterm") for _ in range(2)]
    try:
        workers = [waiting(process) for process in clients]
        clients[0].kill()  # the client cannot forward SIGKILL: the parent sees its connection close
        assert gone(workers[0])
        os.kill(workers[1], signal.SIGKILL)  # the worker: its client ends as it did, for torchrun's report
        assert clients[1].wait(timeout=60) == -signal.SIGKILL
    finally:
        for process in clients:
            process.kill()


def test_the_first_group_a_parent_gone_and_fast_restart_off_start_cold(tmp_path: Path, socket_path: str):
    for process in (
        client(socket_path, "wait-for-sigterm", restart="0"),
        client(str(tmp_path / "none"), "wait-for-sigterm"),
    ):
        try:
            assert waiting(process) == process.pid  # the client became the worker (exec)
        finally:
            process.kill()
    os.environ[warm.VARIABLE] = "0"
    try:
        assert warm.client_args(sys.executable, ["-u", "-m", "experiments.toy"], 3, False) is None
    finally:
        del os.environ[warm.VARIABLE]
    assert warm.client_args(sys.executable, ["-u", "-m", "experiments.toy"], 3, False) == [
        "-u",
        "-m",
        warm.__name__,
        "-u",
        "-m",
        "experiments.toy",
    ]
    assert warm.client_args(sys.executable, ["-u", "-m", "experiments.toy"], 0, False) is None  # no restarts
    assert warm.client_args(sys.executable, ["-u", "-m", "experiments.toy"], 3, True) is None  # NUMA-bound
    assert warm.client_args(sys.executable, ["-u", "train.py"], 3, False) is None


def test_under_heal_the_client_replaces_a_killed_worker_once_per_budget_and_a_stopped_one_never(
    tmp_path: Path, socket_path: str
):
    heal = {"DDP_LAB_HEAL": "1", "DDP_LAB_HEAL_BUDGET": "1", "DDP_LAB_JOB_DIR": str(tmp_path), "RANK": "1"}
    process = client(socket_path, "wait-for-sigterm", restart="0", **heal)
    other = client(socket_path, "wait-for-sigterm", restart="0", **heal)  # the node's other client, same budget
    try:
        first = waiting(process)
        assert parent_of(first) == process.pid  # the first starts cold, the client's child, not exec'd
        (tmp_path / "rank_1").write_text("1\n")  # its heartbeat: it trained (one dead in its set-up is not replaced)
        os.kill(first, signal.SIGKILL)  # a fault: replaced, forked by the warm parent (its variable: tests/e2e)
        second = waiting(process)
        assert second != first and "-m ddp_core.process.warm" in command_line(parent_of(second))
        os.kill(waiting(other), signal.SIGKILL)  # the budget is spent: the client ends as its worker did
        assert other.wait(timeout=60) == -signal.SIGKILL
        process.send_signal(signal.SIGTERM)  # the launcher's stop, forwarded: the probe exits 7, not replaced
        assert process.wait(timeout=60) == 7
        assert sorted(path.name for path in tmp_path.iterdir()) == ["rank_1", "replacement_0"]
    finally:
        for each in (process, other):
            each.kill()
