"""ddp-lab benchmarks, measured side by side in one run (`make bench`, or `python -m bench`).

1. All-gather of a list of 32 tensors: one collective (stack -> all_gather -> unbind) vs a loop of 32
   all_gather calls (and all_gather_object, for reference).
2. The toy model's training step under DDP vs the same step without gradient communication
   (DDP's ``no_sync``), to show what the all-reduce costs at this size.

Each variant is timed in alternating rounds (A, B, A, B, ...) so that machine noise hits both alike;
the figure reported is the median per-call time over rounds, and ratios are of those medians.

Backend: nccl with one GPU per process when this node has a GPU for each of its processes, otherwise
gloo on CPU (a one-GPU host still runs the 2 default processes; the output says so). --backend overrides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from bench.timing import synchronize
from ddp_core.config import CommonArgs, option
from ddp_core.distributed.collectives import all_gather_object, all_gather_tensors
from ddp_core.distributed.group import DistContext, process_group, wrap_ddp
from ddp_core.output.logging import print0
from ddp_core.process.entry import command_main
from ddp_core.process.launch import launch
from experiments.toy import ToyModel


@dataclass
class BenchArgs(CommonArgs):
    nproc: int = option(2, "processes to start (torch.multiprocessing)")
    rounds: int = option(15, "alternating timing rounds per comparison")
    calls: int = option(20, "calls per round")
    tensors: int = option(32, "tensors in the gathered list")


def choose_backend(requested: str, processes_per_node: int, gpus: int) -> str:
    """nccl only when every process of this node gets its own GPU: nccl refuses to share one (exit 2)."""
    if requested != "auto":
        return requested
    return "nccl" if gpus >= processes_per_node else "gloo"


def time_per_call(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    synchronize(device)  # work queued by the previous round must not land in this one
    dist.barrier()  # start every rank's round together
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def compare(variants: dict[str, Callable[[], object]], args: BenchArgs, device: torch.device) -> dict[str, float]:
    """Median seconds per call of each variant, over alternating rounds; rank 0's clock."""
    for fn in variants.values():  # warm-up
        time_per_call(fn, 2, device)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            samples[name].append(time_per_call(fn, args.calls, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_list_all_gather(ctx: DistContext, args: BenchArgs) -> None:
    tensors = [torch.randn(1, 64, device=ctx.device) + ctx.rank for _ in range(args.tensors)]

    def loop() -> None:
        for t in tensors:
            out = [torch.empty_like(t) for _ in range(ctx.world_size)]
            dist.all_gather(out, t)

    result = compare(
        {
            "one collective (all_gather_tensors)": lambda: all_gather_tensors(tensors),
            f"loop of {args.tensors} all_gather": loop,
            "all_gather_object(list)": lambda: all_gather_object(tensors),
        },
        args,
        ctx.device,
    )
    one = result["one collective (all_gather_tensors)"]
    print0(f"\n1. all-gather of {args.tensors} tensors of shape (1, 64), {ctx.world_size} ranks, {ctx.backend}")
    for name, seconds in result.items():
        print0(f"   {name:40s} {seconds * 1e3:8.3f} ms   {seconds / one:6.1f}x the one-collective time")


def bench_toy_step(ctx: DistContext, args: BenchArgs) -> None:
    torch.manual_seed(0)
    model = wrap_ddp(ToyModel(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(32, 10, device=ctx.device), torch.randn(32, 5, device=ctx.device)
    loss_fn = nn.MSELoss()

    def step(sync: bool) -> None:
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()

    result = compare(
        {"DDP step (gradient all-reduce)": lambda: step(True), "same step, no communication": lambda: step(False)},
        args,
        ctx.device,
    )
    ddp, local = result.values()
    print0(f"\n2. toy training step, batch 32 per process, {ctx.world_size} ranks, {ctx.backend}")
    for name, seconds in result.items():
        print0(f"   {name:40s} {seconds * 1e6:8.1f} us")
    print0(
        f"   communication share of the DDP step: {(ddp - local) / ddp:.0%}"
        f"  (DDP step = {ddp / local:.1f}x the local step)"
    )


def run_benchmarks(args: BenchArgs) -> None:
    with process_group(args.dist_config()) as ctx:
        torch.set_num_threads(1)
        print0(
            f"ddp-lab benchmarks: torch {torch.__version__}, {ctx.world_size} processes,"
            f" {ctx.backend}, {ctx.device.type}"
        )
        gpus = torch.cuda.device_count()
        if ctx.backend == "gloo" and gpus:
            print0(
                f"   note: {gpus} GPU(s) for {ctx.env.local_world_size} processes on this node:"
                " gloo on CPU (nccl needs a GPU per process)"
            )
        bench_list_all_gather(ctx, args)
        bench_toy_step(ctx, args)


def launch_on_chosen_backend(worker: Callable[[Any], None], args: Any) -> None:
    """``worker(args)`` in every process, on the backend ``choose_backend`` picks for this node's processes."""
    processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc))  # torchrun's, else ours
    backend = choose_backend(args.backend, processes_per_node, torch.cuda.device_count())
    launch(worker, dataclasses.replace(args, backend=backend))


main = command_main(BenchArgs, functools.partial(launch_on_chosen_backend, run_benchmarks), doc=__doc__)


if __name__ == "__main__":
    main.run_and_exit()
