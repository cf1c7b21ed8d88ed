"""A log point's figures read one log interval later (ddp_core/lifecycle/late_reads.py) in one process, and the parts
of the loop it leans on: the step timer's mark, a stop signal agreed from the figures. At 2 processes against a run
read at once: tests/e2e/test_toy.py; a divergence and a stop signal read late: test_divergence.py, test_faults.py;
the host reads it leaves in the steady state: test_host_syncs.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_core.lifecycle.late_reads import LOG_READS, LateReads, Sent, reads_late
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.step_time import StepTimer


def test_what_was_sent_is_received_once_as_it_was_then():
    late = LateReads()
    assert late.receive() is None  # nothing in flight
    on_device = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    late.send(Sent(step=12, epoch=1, lr=0.5, times_step=8), on_device, [4.0, 5.0])
    on_device.fill_(9.0)  # the loop goes on: the figures sent are a copy
    sent, rows = late.receive()
    assert sent == Sent(12, 1, 0.5, 8) and rows == [[1.0, 2.0, 3.0, 4.0, 5.0]]  # a world of one: one row
    assert late.receive() is None


@pytest.mark.parametrize(
    ("choice", "device", "late"),
    [("auto", "cpu", False), ("auto", "cuda", True), ("late", "cpu", True), ("now", "cuda", False)],
)
def test_auto_reads_late_where_the_device_runs_ahead_of_the_host(choice: str, device: str, late: bool):
    assert choice in LOG_READS and reads_late(choice, torch.device(device)) is late


class Ticks:
    """A clock read later, as CUDA's events are: each mark a number, a step's seconds the difference."""

    deferred = True

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        self.now += 1.0
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start


def test_a_marked_take_hands_over_the_steps_closed_before_the_mark_and_keeps_the_rest():
    timer = StepTimer(nn.Linear(2, 2), torch.device("cpu"))
    timer._clock = Ticks()  # the clock CUDA would use, without a GPU
    timer.restart()
    for _ in range(3):
        timer.end_step()
        timer.start_step()
    timer.mark()  # a log point read late: steps 1-3
    for _ in range(2):
        timer.end_step()
        timer.start_step()
    first = timer.take(marked=True)
    assert first.steps == 3 and first.compute_s == 3.0
    assert timer.take(marked=True).steps == 0  # the mark was used up
    rest = timer.take()
    assert rest.steps == 2 and rest.compute_s == 2.0


def test_a_stop_agreed_from_the_figures_is_a_stop():
    stop = GracefulStop()
    assert stop.agree(False) is False and not stop.stopped
    assert stop.agree(True) is True and stop.stopped
    assert stop.agree(False) is True  # once agreed, it stays
