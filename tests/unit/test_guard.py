"""NonFiniteGuard in one process: what it remembers, what it says, and that finite runs pass."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddp_core.exit_codes import DIVERGED_EXIT_CODE
from ddp_core.training.guard import LOSSES_PER_BUFFER, DivergedError, NonFiniteGuard


def test_finite_losses_and_weights_pass():
    guard = NonFiniteGuard(torch.device("cpu"))
    for step in range(1, 6):
        guard.observe(torch.tensor(1.0 / step), step)
    guard.check(5, nn.Linear(3, 2))


@pytest.mark.parametrize(("bad", "shown"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_the_first_non_finite_step_and_value_are_named_with_the_advice_and_checkpoint(tmp_path, bad, shown):
    checkpoint = tmp_path / "last.pt"
    checkpoint.write_bytes(b"x")
    guard = NonFiniteGuard(torch.device("cpu"), advice="a lower --lr (now 0.1)")
    losses = [0.5, 0.4, bad, math.nan, 0.3]  # the first bad step is remembered, not the last
    for step, loss in enumerate(losses, start=1):
        guard.observe(torch.tensor(loss), step)
    with pytest.raises(DivergedError) as raised:
        guard.check(5, kept=lambda: checkpoint)
    message = str(raised.value)
    assert f"became {shown} at step 3 (rank 0)" in message and "stopped at step 5" in message
    assert "a lower --lr (now 0.1)" in message and str(checkpoint) in message and "\n" not in message
    assert raised.value.exit_code == DIVERGED_EXIT_CODE == 3


def test_without_a_checkpoint_the_message_says_none_was_written(tmp_path):
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.observe(torch.tensor(math.nan), 1)
    with pytest.raises(DivergedError, match="no checkpoint had been written yet"):
        guard.check(1, kept=lambda: tmp_path / "missing.pt")


def test_non_finite_weights_are_caught_before_a_checkpoint_even_with_finite_losses():
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.observe(torch.tensor(0.1), 1)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    guard.check(1, model)
    with torch.no_grad():
        model[1].running_var[0] = math.inf  # a buffer counts too: it is saved in the checkpoint
    with pytest.raises(DivergedError, match="non-finite weights after step 1"):
        guard.check(1, model)


def test_bf16_losses_are_watched_too():
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.observe(torch.tensor(math.inf, dtype=torch.bfloat16), 2)
    with pytest.raises(DivergedError, match="became inf at step 2"):
        guard.check(2)


def test_the_first_bad_step_is_found_past_one_buffer_and_after_earlier_checks():
    guard = NonFiniteGuard(torch.device("cpu"))
    for step in range(1, 11):
        guard.observe(torch.tensor(0.5), step)
    guard.check(10)  # passes: the buffers fill again from their start
    # two micro-batches a step (--grad-accum 2), more than one buffer's worth between two checks
    steps = [step for step in range(11, 11 + LOSSES_PER_BUFFER) for _ in range(2)]
    for index, step in enumerate(steps):
        bad = index in (LOSSES_PER_BUFFER + 3, LOSSES_PER_BUFFER + 8)  # the first: step 11 + (chunk + 3) // 2
        guard.observe(torch.tensor(math.inf if bad else 0.5), step)
    with pytest.raises(DivergedError, match=rf"became inf at step {11 + (LOSSES_PER_BUFFER + 3) // 2} \(rank 0\)"):
        guard.check(steps[-1])


def test_observing_a_loss_is_one_copy_and_no_arithmetic():
    """On a GPU each operation of a step is a kernel launch the host pays for: the guard's per-step share is one
    copy into its buffer (views cost no kernel)."""
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.observe(torch.tensor(0.5), 1)  # the first buffer is allocated here
    loss = torch.tensor(0.25, requires_grad=True) * 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        guard.observe(loss, 2)
    views = {"aten::select", "aten::as_strided", "aten::detach", "detach", "aten::alias"}
    ops = [event.key for event in prof.key_averages() if event.key.startswith("aten::") and event.key not in views]
    assert ops == ["aten::copy_"]
