"""GracefulStop in one process: a signal becomes a request, handlers are restored, a second Ctrl-C interrupts."""

from __future__ import annotations

import os
import signal

import pytest

from ddp_core.distributed import group
from ddp_core.exit_codes import STOPPED_EXIT_CODE
from ddp_core.process import preemption
from ddp_core.process.preemption import GracefulStop


@pytest.fixture(autouse=True)
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_no_signal_means_no_stop_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert signal.getsignal(signal.SIGTERM) != before
        assert not stop.requested()
    assert signal.getsignal(signal.SIGTERM) == before
    stop.exit_if_stopped()  # does not exit


def test_sigterm_becomes_a_request_and_a_stopped_exit_code():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before kill() returns to Python code
        assert stop.received == signal.SIGTERM and stop.requested() and stop.stopped
    with pytest.raises(SystemExit) as exit_info:
        stop.exit_if_stopped()
    assert exit_info.value.code == STOPPED_EXIT_CODE == 143


def test_after_a_stop_a_forwarded_signal_is_ignored_until_exit():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested()
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwarding the signal it got: must not kill the exit path
    assert stop.stopped


def test_a_second_ctrl_c_interrupts_at_once():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_sigterm_taken_before_a_failure_ends_the_wait_for_the_launcher_at_once(monkeypatch):
    """A survivor that got the launcher's SIGTERM while training, then failed on the dead peer, leaves at once:
    waiting for a second SIGTERM would only end in the launcher's SIGKILL after its grace."""
    monkeypatch.setattr(group, "launcher_signalled", group.launcher_signalled.__class__())
    monkeypatch.setattr(preemption, "launcher_signalled", group.launcher_signalled)
    waits = []
    monkeypatch.setattr(group.signal, "sigtimedwait", lambda signals, seconds: waits.append(seconds))
    with pytest.raises(RuntimeError), GracefulStop():
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("Connection closed by peer")
    group.wait_for_the_launcher(group.PEER_EXIT_GRACE_S)
    assert waits == [] and not group.launcher_signalled.is_set()  # taken once: a later failure waits again
    group.wait_for_the_launcher(0.01)
    assert waits == [0.01]


def test_a_sigterm_the_run_stopped_for_or_no_failure_leaves_no_mark(monkeypatch):
    monkeypatch.setattr(group, "launcher_signalled", group.launcher_signalled.__class__())
    monkeypatch.setattr(preemption, "launcher_signalled", group.launcher_signalled)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(RuntimeError), GracefulStop():
        raise RuntimeError("a failure without a signal")
    assert stop.received == signal.SIGTERM and not group.launcher_signalled.is_set()
