"""What the replica check costs: `python -m bench.replica_check` (part of `make bench`).

For the toy model and CIFAR10's ``small`` model (batch norm synchronized, as the experiment builds it), in
N processes (default 2), a full training step under DDP (forward, loss, backward, SGD update) is timed
with the replica check after every step (``ddp_core.training.replicas``: fingerprints of every parameter
and compared buffer, one all_gather) against the same step without it, in alternating rounds (medians,
rank 0's clock). The ratio is the cost of checking at every step; at ``--check-replicas-every N`` the
overhead is about (ratio - 1) / N. Output: a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from bench.ddp import BenchArgs, compare, launch_on_chosen_backend
from ddp_core.config import option
from ddp_core.distributed.group import DistContext, process_group, wrap_ddp
from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm
from ddp_core.output.logging import print0
from ddp_core.process.entry import command_main
from ddp_core.training.replicas import ReplicaCheck
from experiments.cifar10_models import build_model
from experiments.toy import ToyModel


@dataclass
class ReplicaBenchArgs(BenchArgs):
    rounds: int = option(7, "alternating timing rounds per comparison")
    calls: int = option(10, "training steps per round")


def training_step(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: nn.Module
) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def models(ctx: DistContext) -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor, nn.Module]]:
    generator = torch.Generator().manual_seed(ctx.rank)
    small = build_model("small", num_classes=10)
    if ctx.world_size > 1:
        small = convert_sync_batchnorm(small, ctx.device)
    return {
        "toy (batch 16)": (
            ToyModel(),
            torch.randn(16, 10, generator=generator),
            torch.randn(16, 5, generator=generator),
            nn.MSELoss(),
        ),
        "cifar10 small (batch 32)": (
            small,
            torch.randn(32, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (32,), generator=generator),
            nn.CrossEntropyLoss(),
        ),
    }


def run(args: ReplicaBenchArgs) -> None:
    with process_group(args.dist_config()) as ctx:
        torch.manual_seed(0)
        rows = []
        for name, (model, inputs, targets, loss_fn) in models(ctx).items():
            ddp = wrap_ddp(model, ctx)
            step = training_step(ddp, inputs.to(ctx.device), targets.to(ctx.device), loss_fn.to(ctx.device))
            check = ReplicaCheck(ddp, ctx.device)

            def checked(step: Callable[[], None] = step, check: ReplicaCheck = check) -> None:
                step()
                check.check(0)

            times = compare({"off": step, "every step": checked}, args, ctx.device)
            rows.append((name, len(check.named), times["off"], times["every step"]))
        print0(
            f"Replica check, {ctx.world_size} processes, backend {ctx.backend}/{ctx.device.type},"
            f" medians of {args.rounds} rounds x {args.calls} steps"
        )
        print0(
            "| model | tensors compared | step, check off (ms) | step + check every step (ms) |"
            " ratio | at every 100 steps |"
        )
        print0("|---|---|---|---|---|---|")
        for name, tensors, off, every in rows:
            print0(
                f"| {name} | {tensors} | {off * 1e3:.2f} | {every * 1e3:.2f} |"
                f" {every / off:.3f} | +{(every / off - 1) / 100:.3%} |"
            )


main = command_main(ReplicaBenchArgs, functools.partial(launch_on_chosen_backend, run), doc=__doc__)


if __name__ == "__main__":
    main.run_and_exit()
