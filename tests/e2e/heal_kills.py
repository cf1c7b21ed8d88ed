"""An experiment (HEAL_EXPERIMENT, default experiments.toy) with its worker of rank HEAL_KILL_RANK SIGKILLed once per
incarnation, for tests/e2e/test_heal.py.

    python -m ddp_core.torchrun ... --heal -m tests.e2e.heal_kills [the experiment's flags]

HEAL_KILLS lists where each incarnation of that rank dies (the first, then each replacement, counted by
DDP_LAB_HEAL_REPLACEMENT; one past the list runs clean): ``forward:K``, in its K-th loss (inside a step:
the others' all-reduce fails and the step is abandoned); ``after:K``, right after its K-th optimizer step, once
every rank committed it; ``gather:K``, in its K-th all-gather (a log point's: the others fail in that pause, which
then runs again).
Test code only: the experiment has no fault hook.
"""

from __future__ import annotations

import os
import runpy
import signal

import torch


def die_at(target: type, name: str, calls: int) -> None:
    """SIGKILL this process in the ``calls``-th call of ``target.name`` (on its way in)."""
    original, count = getattr(target, name), 0

    def dying(*args, **kwargs):
        nonlocal count
        count += 1
        if count == calls:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(target, name, dying)


if os.environ.get("RANK") == os.environ["HEAL_KILL_RANK"]:
    kills = [kill.split(":") for kill in os.environ["HEAL_KILLS"].split(",")]
    incarnation = int(os.environ.get("DDP_LAB_HEAL_REPLACEMENT") or 0)
    if incarnation < len(kills):
        where, calls = kills[incarnation]
        if where == "forward":
            for loss in (torch.nn.MSELoss, torch.nn.CrossEntropyLoss):  # the toy's, CIFAR10's: one per forward pass
                die_at(loss, "forward", int(calls))
        elif where == "gather":  # in its K-th all-gather: a log point's (a pause, after a committed step)
            die_at(torch.distributed, "all_gather", int(calls))
        else:  # the step after the optimizer's K-th: its zero_grad follows it
            die_at(torch.optim.SGD, "zero_grad", int(calls))
runpy.run_module(os.environ.get("HEAL_EXPERIMENT", "experiments.toy"), run_name="__main__")
