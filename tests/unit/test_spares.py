"""Warm spares (ddp_core/process/spares.py): which worker a spare may become, and what it is told. The spare's own
side, run for real, is exercised by bench.recovery --warm-spares (a restarted run ends bitwise)."""

from __future__ import annotations

import io
import json

from ddp_core.process.spares import Spares


class FakeSpare:
    """What Spares uses of a Popen: a stdin to write the order to, and poll()."""

    def __init__(self, command: list[str], **kwargs: object) -> None:
        self.command, self.kwargs = command, kwargs
        self.stdin = io.BytesIO()
        self.stdin.close = lambda: None  # keep the bytes readable for the test
        self.exitcode: int | None = None

    def poll(self) -> int | None:
        return self.exitcode


def test_a_spare_becomes_the_worker_it_was_started_for_once():
    spares = Spares()
    spares.start("/venv/python", "experiments.toy", 2, FakeSpare)
    started = list(spares.ready[("/venv/python", "experiments.toy")])
    assert [spare.command for spare in started] == [["/venv/python", "-u", "-m", "ddp_core.process.spares"]] * 2
    assert all(spare.kwargs["start_new_session"] for spare in started)  # as torchrun starts its workers
    worker = ["/venv/python", "-u", "-m", "experiments.toy", "--steps", "9"]
    first = spares.take(worker, {"RANK": "1"})
    assert first is started[0]
    order = json.loads(first.stdin.getvalue())
    assert order == {"argv": ["experiments.toy", "--steps", "9"], "env": {"RANK": "1"}}
    assert spares.take(worker, {"RANK": "0"}) is started[1]
    assert spares.take(worker, {"RANK": "2"}) is None  # both handed out
    spares.start("/venv/python", "experiments.toy", 2, FakeSpare)  # topped up for the next restart
    assert len(spares.ready[("/venv/python", "experiments.toy")]) == 2


def test_no_spare_for_another_command_redirected_output_or_a_spare_that_died():
    spares = Spares()
    spares.start("/venv/python", "experiments.toy", 1, FakeSpare)
    assert spares.take(["/venv/python", "-u", "-m", "experiments.cifar10"], {}) is None  # another module
    assert spares.take(["/venv/python", "-u", "train.py"], {}) is None  # a script, not -m
    assert spares.take(["/venv/python", "-u", "-m", "experiments.toy"], {}, stdout="/tmp/log") is None  # --redirects
    spares.ready[("/venv/python", "experiments.toy")][0].exitcode = -9
    assert spares.take(["/venv/python", "-u", "-m", "experiments.toy"], {}) is None
