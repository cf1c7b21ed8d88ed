"""The metrics log's throughput: training steps only, the warm-up left out, evaluation and saves reported apart.

A fake clock drives ``MetricsLog`` as the loop does (count a step, pause for a log or an evaluation, resume), so
every figure has a closed form: a step takes 1 s in the warm-up and 0.5 s after it, evaluation 3 s, a pause 7 s.
"""

from __future__ import annotations

import pytest
import torch

from ddp_core.lifecycle import metrics_log
from ddp_core.lifecycle.metrics_log import MetricsLog
from ddp_core.lifecycle.plan import Plan


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Stub:
    """What MetricsLog asks of the run, its writer and the per-rank times: nothing it reports from."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self if name == "open_writer" else None


class Args:
    log_every = 0
    eval_every = 0


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(metrics_log.time, "perf_counter", clock)
    return clock


def metrics_for(plan: Plan) -> MetricsLog:
    return MetricsLog(Stub(), Args(), plan, torch.device("cpu"), None, Stub())


def train(log: MetricsLog, clock: Clock, steps: int, seconds_per_step: float, *, per_epoch: int) -> list[int]:
    """Steps as the loop counts them; returns the steps where the warm-up ended."""
    ended = []
    for step in range(1, steps + 1):
        if (step - 1) % per_epoch == 0:
            log.begin_epoch()
        clock.now += seconds_per_step if log._warmup is None else seconds_per_step / 2
        log.count_step()
        if log.warmup_ends(step, epoch_done=step % per_epoch == 0):
            log.end_warmup()
            ended.append(step)
        if step % per_epoch == 0:  # the epoch's end: logged, evaluated, saved, with the clock paused
            log.pause_clock()
            clock.now += 7
            log.resume_clock()
    return ended


@pytest.mark.parametrize("epochs", [2, 3, 5])
def test_the_first_epoch_is_the_warm_up_and_pauses_are_not_training(clock: Clock, epochs: int):
    steps_per_epoch, batch = 4, 8
    log = metrics_for(Plan(epochs * steps_per_epoch, steps_per_epoch, batch))
    assert train(log, clock, epochs * steps_per_epoch, 1.0, per_epoch=steps_per_epoch) == [steps_per_epoch]
    speed, warmup_steps = log.throughput()
    assert warmup_steps == steps_per_epoch
    assert speed == pytest.approx(batch / 0.5)  # the steady steps only: neither the warm-up nor the pauses


def test_a_run_of_one_epoch_ends_its_warm_up_at_the_first_log_interval(clock: Clock):
    log = metrics_for(Plan(20, 20, 4))  # log_every 0: about ten points an epoch, so every 2 steps
    assert train(log, clock, 20, 1.0, per_epoch=20) == [log.every]
    assert log.throughput() == (pytest.approx(4 / 0.5), log.every)


def test_a_run_that_ends_in_its_warm_up_reports_all_its_steps(clock: Clock):
    log = metrics_for(Plan(8, 4, 2))
    train(log, clock, 3, 1.0, per_epoch=4)  # stopped before the first epoch ended, then saved (paused)
    log.pause_clock()
    assert log.throughput() == (pytest.approx(2 / 1.0), 0)


def test_evaluation_time_is_counted_apart_and_saves_each_have_their_stall(clock: Clock):
    def evaluate(step: int, writer: object) -> dict[str, float]:
        clock.now += 3
        return {"accuracy": 0.5}

    log = metrics_for(Plan(4, 2, 2, per_epoch=True, evaluate=evaluate))
    log.evaluate(2)
    log.evaluate(4)
    log.checkpoint_stalled(0.25)
    log.checkpoint_stalled(0.75)
    assert log.eval_seconds == pytest.approx(6)
    assert log.checkpoint_stalls_ms == [pytest.approx(250), pytest.approx(750)]
