"""Demos of torch.distributed's collective operations, each checked against its closed-form result.

Every rank starts from inputs that depend on its rank, so the expected result of each collective can
be written down; a wrong result makes the run fail (exit 1). Output is printed in rank order.

Launch (every command from the repository root):

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.collectives       # every demo
    python -m ddp_core.torchrun --standalone --nproc-per-node=3 -m experiments.collectives --demo all_gather_list
    python -m experiments.collectives --nproc 2                                        # no torchrun
    python -m experiments.collectives --list                                           # names of the demos

Demos: all_gather, gather, all_gather_list (a list of tensors in one collective via cat/chunk),
all_gather_varsize, all_gather_object, broadcast, all_reduce, reduce, scatter, reduce_scatter,
all_to_all, barrier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ddp_core.config import CommonArgs, option, require
from ddp_core.distributed.collectives import (
    all_gather_object,
    all_gather_tensors,
    all_gather_varsize,
    gather_tensors,
    print_in_rank_order,
)
from ddp_core.distributed.group import DistContext, process_group
from ddp_core.output.logging import print0
from ddp_core.process.entry import entry_main

KIND = "demo"  # python -m experiments lists it apart (ddp_core.experiment_files): it trains nothing


class DemoError(RuntimeError):
    """A collective returned something other than its closed-form result."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise DemoError(what)


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.shape == expected.shape and torch.equal(actual.cpu(), expected.cpu())


def demo_all_gather(ctx: DistContext) -> None:
    r, world, dev = ctx.rank, ctx.world_size, ctx.device
    x = torch.arange(3, dtype=torch.float32, device=dev).unsqueeze(0) + 10 * r
    print_in_rank_order(f"On rank {r}", x)
    gathered = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    print_in_rank_order(f"Gathered on rank {r}", gathered)
    for i, got in enumerate(gathered):
        _expect(_equal(got, torch.arange(3.0).unsqueeze(0) + 10 * i), f"slot {i} holds {got.tolist()}")


def demo_gather(ctx: DistContext) -> None:
    r, dev = ctx.rank, ctx.device
    x = torch.arange(3, dtype=torch.float32, device=dev).unsqueeze(0) + 10 * r
    print_in_rank_order(f"On rank {r}", x)
    gathered = gather_tensors(x, dst=0)  # only the destination rank receives a list
    print_in_rank_order(f"Gather list on rank {r}", gathered)
    if r == 0:
        assert gathered is not None
        for i, got in enumerate(gathered):
            _expect(_equal(got, torch.arange(3.0).unsqueeze(0) + 10 * i), f"slot {i} holds {got.tolist()}")
    else:
        _expect(gathered is None, "a rank other than dst received a list")


def demo_all_gather_list(ctx: DistContext) -> None:
    r, dev = ctx.rank, ctx.device
    tensors = [torch.tensor([[100.0 * r + 10 * j, 100.0 * r + 10 * j + 1]], device=dev) for j in range(3)]
    print_in_rank_order("List of tensors", tensors)
    print_in_rank_order("Concatenated tensor", torch.cat(tensors, -1))
    gathered = all_gather_tensors(tensors)  # cat -> ONE all_gather -> split
    flat = [t for per_rank in gathered for t in per_rank]
    print_in_rank_order("Gathered un-concatenated", flat)
    for i, per_rank in enumerate(gathered):
        for j, got in enumerate(per_rank):
            want = torch.tensor([[100.0 * i + 10 * j, 100.0 * i + 10 * j + 1]])
            _expect(_equal(got, want), f"rank {i} tensor {j} holds {got.tolist()}")


def demo_all_gather_varsize(ctx: DistContext) -> None:
    r, dev = ctx.rank, ctx.device
    x = torch.full((r + 1, 2), float(r), device=dev)  # rank r contributes r + 1 rows
    print_in_rank_order(f"On rank {r} ({r + 1} rows)", x)
    gathered = all_gather_varsize(x)
    print_in_rank_order(f"Gathered on rank {r}", gathered)
    for i, got in enumerate(gathered):
        _expect(_equal(got, torch.full((i + 1, 2), float(i))), f"rank {i}'s rows arrived as {got.tolist()}")


def demo_all_gather_object(ctx: DistContext) -> None:
    r, dev = ctx.rank, ctx.device

    def data_of(rank: int, device: torch.device) -> dict:
        return {
            "tensor": torch.ones(3, device=device) + rank,
            "list": [1 + rank, 2 + rank, 3 + rank],
            "dict": {"rank": rank},
        }

    data = data_of(r, dev)
    print_in_rank_order(f"On rank {r}", data)
    outputs = all_gather_object(data)
    print_in_rank_order(f"Gathered on rank {r}", outputs)
    for i, got in enumerate(outputs):
        want = data_of(i, torch.device("cpu"))
        _expect(
            _equal(got["tensor"], want["tensor"]) and got["list"] == want["list"] and got["dict"] == want["dict"],
            f"object {i} is {got}",
        )
        # pickle alone would put rank i's GPU tensor on cuda:i of every rank;
        # ddp_core's helper puts it on this rank's GPU
        _expect(
            got["tensor"].device == dev,
            f"object {i}'s tensor arrived on {got['tensor'].device}, not on this rank's {dev}",
        )


def demo_broadcast(ctx: DistContext) -> None:
    r = ctx.rank
    x = torch.full((3,), float(r + 1), device=ctx.device)
    print_in_rank_order(f"Before broadcast from rank 0, rank {r} has", x)
    dist.broadcast(x, src=0)
    print_in_rank_order(f"After, rank {r} has", x)
    _expect(_equal(x, torch.ones(3)), f"got {x.tolist()}, expected rank 0's ones")


def demo_all_reduce(ctx: DistContext) -> None:
    r, world = ctx.rank, ctx.world_size
    x = torch.full((2,), float(r + 1), device=ctx.device)
    print_in_rank_order(f"On rank {r}", x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    print_in_rank_order(f"Sum on rank {r} (1 + 2 + ... + {world})", x)
    _expect(_equal(x, torch.full((2,), world * (world + 1) / 2)), f"got {x.tolist()}")


def demo_reduce(ctx: DistContext) -> None:
    r, world = ctx.rank, ctx.world_size
    x = torch.full((2,), float(r + 1), device=ctx.device)
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
    print_in_rank_order(f"Rank {r} after reduce to rank 0" + (" (the sum)" if r == 0 else " (unspecified off dst)"), x)
    if r == 0:
        _expect(_equal(x, torch.full((2,), world * (world + 1) / 2)), f"got {x.tolist()}")


def demo_scatter(ctx: DistContext) -> None:
    r, world, dev = ctx.rank, ctx.world_size, ctx.device
    pieces = [torch.full((2,), 10.0 * i, device=dev) for i in range(world)] if r == 0 else None
    if r == 0:
        print_in_rank_order("Rank 0 scatters", pieces)
    else:
        print_in_rank_order(f"Rank {r} waits")
    out = torch.zeros(2, device=dev)
    dist.scatter(out, scatter_list=pieces, src=0)
    print_in_rank_order(f"Rank {r} received", out)
    _expect(_equal(out, torch.full((2,), 10.0 * r)), f"got {out.tolist()}")


def demo_reduce_scatter(ctx: DistContext) -> None:
    r, world, dev = ctx.rank, ctx.world_size, ctx.device
    inputs = [torch.full((2,), r + 10.0 * i, device=dev) for i in range(world)]  # piece i goes to rank i
    print_in_rank_order(f"Rank {r} contributes", inputs)
    out = torch.zeros(2, device=dev)
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
    print_in_rank_order(f"Rank {r} receives the sum of everyone's piece {r}", out)
    _expect(_equal(out, torch.full((2,), world * (world - 1) / 2 + 10.0 * r * world)), f"got {out.tolist()}")


def demo_all_to_all(ctx: DistContext) -> None:
    r, world, dev = ctx.rank, ctx.world_size, ctx.device
    send = [torch.tensor([100.0 * r + j], device=dev) for j in range(world)]  # piece j goes to rank j
    print_in_rank_order(f"Rank {r} sends", send)
    received = [torch.zeros(1, device=dev) for _ in range(world)]
    dist.all_to_all(received, send)
    print_in_rank_order(f"Rank {r} received", received)
    for j, got in enumerate(received):
        _expect(_equal(got, torch.tensor([100.0 * j + r])), f"piece from rank {j} is {got.tolist()}")


def demo_barrier(ctx: DistContext) -> None:
    """The case for a barrier: one rank prepares something (a download, a file) the others then use."""
    r = ctx.rank
    key = "demo/barrier/prepared"
    assert ctx.store is not None
    if r == 0:
        ctx.store.set(key, "prepared by rank 0 before the barrier")
    dist.barrier()
    seen = ctx.store.check([key])
    print_in_rank_order(f"Rank {r} after the barrier sees rank 0's work", seen)
    _expect(seen, "rank 0's work was not visible after the barrier")


DEMOS: dict[str, Callable[[DistContext], None]] = {
    name.removeprefix("demo_"): fn for name, fn in globals().items() if name.startswith("demo_")
}
UNSUPPORTED_WORDS = ("not supported", "unsupported", "does not support", "not implemented")


@dataclass
class CollectivesArgs(CommonArgs):
    demo: str = option(
        "all",
        "run one demo by name (see --list), or all",
        check=lambda name: None if name == "all" or name in DEMOS else "is not a demo",
        accepts="all or one of " + ", ".join(DEMOS),
    )
    list: bool = option(False, "print the names of the demos and exit")


def run_demo(name: str, ctx: DistContext) -> str:
    """'ok', 'unsupported on BACKEND', or 'FAILED: ...' — agreed by every rank."""
    print0(f"\n=== {name} ({ctx.world_size} ranks, {ctx.backend}) ===\n")
    outcome = "ok"
    try:
        DEMOS[name](ctx)
    except DemoError as error:
        outcome = f"FAILED on rank {ctx.rank}: {error}"
    except RuntimeError as error:
        if not any(word in str(error).lower() for word in UNSUPPORTED_WORDS):
            raise
        outcome = f"unsupported on {ctx.backend}"
    outcomes = all_gather_object(outcome)
    failures = [o for o in outcomes if o.startswith("FAILED")]
    return failures[0] if failures else outcomes[0]


def run_all(args: CollectivesArgs) -> dict[str, str]:
    names = list(DEMOS) if args.demo == "all" else [args.demo]
    with process_group(args.dist_config()) as ctx:
        results = {name: run_demo(name, ctx) for name in names}
        print0("\nSummary:")
        for name, outcome in results.items():
            print0(f"  {name:20s} {outcome}")
    failed = [name for name, outcome in results.items() if outcome.startswith("FAILED")]
    if failed:
        raise DemoError(f"{len(failed)} demo(s) gave a wrong result: {', '.join(failed)}")
    return results


def list_demos(args: CollectivesArgs) -> bool:
    if args.list:
        print("\n".join(DEMOS))
    return args.list


def validate(args: CollectivesArgs) -> None:
    require(
        args.demo == "all" or args.demo in DEMOS,
        f"--demo={args.demo!r} is not a demo: use one of all, {', '.join(DEMOS)}",
    )


main = entry_main(CollectivesArgs, run_all, doc=__doc__, validate=validate, answer=list_demos)

if __name__ == "__main__":
    main.run_and_exit()
