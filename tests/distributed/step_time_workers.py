"""Spawned ranks that train the toy model under DDP with and without the step timer and the byte count.

``trainings`` trains every communication hook twice in one spawned world: first as before (torch's hook
registered directly, no timer: what a run did before it measured anything), then the way ``TrainingRun`` does
now (``CommHook.register`` and a ``StepTimer``).
``slow_rank`` trains with one rank sleeping in each step, before its backward or after it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.distributed.group import wrap_ddp
from ddp_core.training.comm import COMM_HOOKS, CommHook
from ddp_core.training.step_time import StepTimer
from experiments.toy import ToyModel
from tests.distributed.harness import context

STEPS = 6
POWERSGD_START = 2  # PowerSGD's plain steps (the whole bucket) before it sends its factors


def _raw_hook(model: nn.parallel.DistributedDataParallel, name: str) -> None:
    """torch's hook registered directly, as ``CommHook.register`` does, without the timer and the count."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=POWERSGD_START
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _train(
    rank: int, hook: str, instrumented: bool, slow: tuple[str, int, float] | None = None, steps: int = STEPS
) -> dict[str, Any]:
    ctx = context()
    torch.manual_seed(0)
    model = wrap_ddp(ToyModel(), ctx)
    comm, timer = None, None
    if instrumented:
        comm = CommHook(hook, rank=1, start_step=POWERSGD_START)
        comm.register(model)
        timer = StepTimer(model, ctx.device, on_synced_pass=comm.count_pass)
    else:
        _raw_hook(model, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, sent = [], []
    for _ in range(steps):
        inputs, targets = torch.randn(16, 10, generator=generator), torch.randn(16, 5, generator=generator)
        if slow is not None and slow[1] == rank and slow[0] == "before backward":
            time.sleep(slow[2])  # the injected fault: a slow rank; the others wait in DDP's all-reduce
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if slow is not None and slow[1] == rank and slow[0] == "after backward":
            time.sleep(slow[2])  # the others wait in the next collective of the run's own
        optimizer.step()
        losses.append(loss.detach().clone())
        flag = torch.zeros(1)
        if timer is not None:
            with timer.waiting():
                dist.all_reduce(flag)  # as the run's stop-signal question
            timer.end_step()
            sent.append(comm.sent_bytes - sum(sent))
            timer.start_step()
        else:
            dist.all_reduce(flag)
    times = timer.take() if timer is not None else None
    return {
        "params": {name: p.detach().clone() for name, p in model.module.named_parameters()},
        "losses": torch.stack(losses),
        "sent": sent,
        "times": None if times is None else (times.compute_s, times.comm_wait_s, times.steps),
    }


def trainings(rank: int, world_size: int) -> dict[tuple[str, bool], dict[str, Any]]:
    before = {(hook, False): _train(rank, hook, instrumented=False) for hook in COMM_HOOKS}
    return {**before, **{(hook, True): _train(rank, hook, instrumented=True) for hook in COMM_HOOKS}}


def slow_rank(rank: int, world_size: int, seconds: float) -> dict[str, Any]:
    return {
        where: _train(rank, "none", instrumented=True, slow=(where, world_size - 1, seconds))["times"]
        for where in ("before backward", "after backward")
    }
