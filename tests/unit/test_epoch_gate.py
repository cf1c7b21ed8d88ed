"""bench.epoch_gate: the pause bench.step_overhead asks for after each epoch's training steps.

The gate waits for the benchmark's go and sends the epoch's number; without the variable, or with nobody
listening, the run goes on. (The bench's own test runs it end to end: one pause per epoch.)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import epoch_gate


@pytest.fixture
def gate_path(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "gate"
    monkeypatch.setenv(epoch_gate.VARIABLE, str(path))
    return path


@pytest.fixture
def waiting(gate_path: Path) -> Iterator[tuple[socket.socket, threading.Thread]]:
    """The benchmark's end of the gate, and a run that has just reached it after its 7th epoch."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(gate_path))
        server.listen(1)
        run = threading.Thread(target=epoch_gate.trained, args=(7,))
        run.start()
        connection, _ = server.accept()
        with connection:
            yield connection, run
        run.join(timeout=30)


def test_the_run_waits_for_the_go_after_naming_its_epoch(waiting):
    connection, run = waiting
    assert connection.recv(64) == b"7\n"
    run.join(timeout=0.5)  # a gate that did not wait would have returned by now
    assert run.is_alive()
    connection.sendall(b"g")
    run.join(timeout=30)
    assert not run.is_alive()


def test_a_closed_connection_lets_the_run_go_on(waiting):
    connection, run = waiting
    connection.close()  # the benchmark stopped mid-pause
    run.join(timeout=30)
    assert not run.is_alive()


def test_nobody_listening_or_no_variable_never_stops_the_run(gate_path: Path, monkeypatch):
    epoch_gate.trained(1)  # the socket does not exist: returns, raises nothing
    gate_path.write_text("not a socket")
    epoch_gate.trained(2)
    monkeypatch.delenv(epoch_gate.VARIABLE)
    epoch_gate.trained(3)
