import math

import pytest

from ddp_core.training.schedules import lr_at


@pytest.mark.parametrize("schedule", ["onecycle", "cosine"])
def test_warmup_rises_linearly_to_the_peak_then_decays_to_the_floor(schedule):
    total, warmup, peak, floor = 100, 10, 0.4, 0.05
    lrs = [lr_at(s, total, peak, warmup, schedule, floor) for s in range(total + 1)]
    assert lrs[:warmup] == pytest.approx([peak * (s + 1) / warmup for s in range(warmup)])
    assert lrs[warmup] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))  # never rises after warm-up
    assert lrs[total] == pytest.approx(peak * floor)


def test_shapes_at_the_midpoint_of_the_decay():
    total, warmup, peak = 110, 10, 1.0
    assert lr_at(60, total, peak, warmup, "onecycle") == pytest.approx(0.5)
    assert lr_at(35, total, peak, warmup, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="onecycle, cosine"):
        lr_at(0, 10, 0.1, schedule="step")
