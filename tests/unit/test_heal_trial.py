"""bench.heal_trial's figures: a survivor's wait is its longest pause between commits after a kill, and a
replica's batch is a function of (seed, replica, step) only, so a retried step and a replacement train on the same
samples. The trial itself needs torchft (an optional extra): run it by hand, `python -m bench.heal_trial`."""

from __future__ import annotations

import torch

from bench.heal_trial import batch, survivor_wait
from experiments.toy import make_dataset


def test_the_wait_is_the_longest_pause_after_the_kill_up_to_the_next_one():
    commits = [1.0, 1.01, 1.02, 4.0, 4.01, 9.0, 9.01]
    assert survivor_wait(commits, kill=1.015, until=5.0) == 4.0 - 1.02  # the step in flight commits after it
    assert survivor_wait(commits, kill=1.025, until=5.0) == 4.0 - 1.025
    assert survivor_wait(commits, kill=4.005, until=20.0) == 9.0 - 4.01


def test_a_batch_depends_on_seed_replica_and_step_only():
    data = make_dataset(4096, 0)
    first, again = batch(0, 1, 7, data), batch(0, 1, 7, data)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], batch(0, 0, 7, data)[0])
    assert not torch.equal(first[0], batch(0, 1, 8, data)[0])
