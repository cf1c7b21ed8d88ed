"""The step timer and the byte count measure without changing the training, and measure what they say.

One spawned world of 3 trains the toy 6 steps with every communication hook, first as before (no timer, torch's
hook registered directly), then as a run does now; a second world makes its last rank sleep in every step.
"""

from __future__ import annotations

import pytest
import torch

from ddp_core.training.comm import COMM_HOOKS
from tests.distributed.harness import run_distributed
from tests.distributed.step_time_workers import STEPS, slow_rank, trainings

WORLD = 3
SLEEP_S = 0.05  # the injected fault, in every step of the last rank


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_distributed(trainings, WORLD, tmp_dir=tmp_path_factory.mktemp("trainings"))


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    return run_distributed(slow_rank, WORLD, SLEEP_S, tmp_dir=tmp_path_factory.mktemp("slow"))


@pytest.mark.parametrize("hook", COMM_HOOKS)
def test_measuring_leaves_the_training_bitwise_as_it_was(trained, hook):
    for rank, result in enumerate(trained):
        before, now = result[hook, False], result[hook, True]
        assert torch.equal(before["losses"], now["losses"]), (rank, hook)
        assert all(torch.equal(before["params"][name], now["params"][name]) for name in before["params"]), (rank, hook)
    assert not torch.equal(
        trained[0]["none", True]["params"]["net1.weight"], trained[0]["fp16", True]["params"]["net1.weight"]
    )


# The toy's gradients: net1 10x10 + 10, net2 5x10 + 5 = 165 float32 = 660 bytes. fp16/bf16 send 2 bytes each.
# PowerSGD at rank 1 sends the whole bucket in its 2 plain steps, then P and Q of the two matrices
# ((10 + 10) + (5 + 10)) and the biases whole (10 + 5): 50 floats.
SENT = {
    "none": [660] * STEPS,
    "fp16": [330] * STEPS,
    "bf16": [330] * STEPS,
    "powersgd": [660, 660] + [200] * (STEPS - 2),
}


@pytest.mark.parametrize("hook", COMM_HOOKS)
def test_the_bytes_handed_to_all_reduce_are_counted_per_step(trained, hook):
    assert [result[hook, True]["sent"] for result in trained] == [SENT[hook]] * WORLD


@pytest.mark.parametrize("where", ["before backward", "after backward"])
def test_the_slow_rank_computes_and_the_others_wait(slowed, where):
    """Slept before backward, the others wait in DDP's all-reduce; after it, in the run's own next collective."""
    times = [result[where] for result in slowed]
    assert [steps for _, _, steps in times] == [STEPS] * WORLD
    compute, wait = [c for c, _, _ in times], [w for _, w, _ in times]
    slept = STEPS * SLEEP_S
    assert compute[-1] >= slept  # the sleep is the slow rank's compute
    assert all(seconds < compute[-1] - slept / 2 for seconds in compute[:-1])
    assert all(seconds > slept / 2 for seconds in wait[:-1])  # the fast ranks wait for most of it
    assert wait[-1] < min(wait[:-1])
