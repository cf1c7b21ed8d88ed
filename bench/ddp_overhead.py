"""DDP's overhead on the CIFAR10 models: `python -m bench.ddp_overhead` (part of `make bench`).

For each model of experiments.cifar10_models, in N processes (default 2), a full training step
(forward, label-smoothed cross-entropy, backward, Nesterov SGD update) under DDP is timed against the
same step inside ``model.no_sync()``, which skips DDP's gradient all-reduce. Variants: DDP's bucket
size (``bucket_cap_mb``: 25 MB, its default, against a small and a large one) and gradient
accumulation (N-1 micro-steps under ``no_sync``, then one synchronised, per optimizer step; the
no-communication side runs all N under ``no_sync``). Times are per optimizer step.

The model is built as the CIFAR10 experiment builds it: batch norm synchronised across ranks
(``convert_sync_batchnorm``: GlobalBatchNorm on CPU, torch's SyncBatchNorm on CUDA; --no-sync-bn for
plain BatchNorm), then wrapped in DDP. Batch-norm collectives run in both steps: the ratio is what the
gradient communication adds. float32, no autocast; random images, a different batch on each rank.

Every (DDP, no-communication) pair of every variant of a model is timed in alternating rounds
(A, B, A, B, ...), after one untimed step of each bucket size's pair, so machine noise hits them alike;
the figures are medians over rounds, on rank 0's clock, and the ratio is of those medians. Output: a
markdown table to paste into docs/benchmarks.md, or --json.

Backend: nccl with one GPU per process where there is one for each, otherwise gloo on CPU (as bench.ddp).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from bench.ddp import launch_on_chosen_backend, time_per_call
from ddp_core.config import MAX_NPROC, CommonArgs, option
from ddp_core.distributed.group import DistContext, process_group
from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm
from ddp_core.output.logging import print0
from ddp_core.process.entry import command_main
from experiments.cifar10_models import MODELS, build_model

DEFAULT_BUCKET_MB = 25.0  # DDP's own default bucket_cap_mb
MAX_BUCKET_MB = 65536.0


def _names(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


def models_problem(value: str) -> str | None:
    names = _names(value)
    if any(name not in MODELS for name in names):
        return "names an unknown model"
    if len(set(names)) != len(names):
        return "names a model twice"
    return None


def bucket_sizes(value: str) -> list[float]:
    return [float(part) for part in _names(value)]


def buckets_problem(value: str) -> str | None:
    try:
        sizes = bucket_sizes(value)
    except ValueError:
        return "is not a list of numbers"
    if not all(math.isfinite(size) and 0 < size <= MAX_BUCKET_MB for size in sizes):
        return "has a size out of range"
    if len(set(sizes)) != len(sizes):
        return "has a size twice"
    return None


@dataclass
class OverheadArgs(CommonArgs):
    nproc: int = option(2, "processes to start (torch.multiprocessing; 1 under torchrun)", minimum=1, maximum=MAX_NPROC)
    models: str = option(
        ",".join(MODELS),
        "CIFAR10 models to measure, comma-separated",
        check=models_problem,
        accepts=f"comma-separated names from {', '.join(MODELS)}, each once",
    )
    batch_size: int = option(32, "images per process per micro-step", minimum=1, maximum=4096)
    bucket_mb: str = option(
        "25,1,100",
        "DDP bucket_cap_mb values, comma-separated (25 MB is DDP's default)",
        check=buckets_problem,
        accepts=f"comma-separated numbers in (0, {MAX_BUCKET_MB:g}] (MB), each once",
    )
    grad_accum: int = option(
        4,
        "micro-steps per optimizer step in the accumulation variant (with the first --bucket-mb)",
        minimum=2,
        maximum=64,
        note="1 is the plain variant, always measured",
    )
    rounds: int = option(3, "alternating timing rounds", minimum=1, maximum=1000)
    steps: int = option(1, "optimizer steps per variant per round", minimum=1, maximum=1000)
    threads: int = option(1, "torch intra-op threads per process", minimum=1, maximum=256)
    sync_bn: bool = option(True, "synchronised batch norm, as the CIFAR10 experiment (off: per-rank BatchNorm)")
    json: bool = option(False, "print the results as JSON instead of a markdown table")


@dataclass(frozen=True)
class Variant:
    bucket_mb: float
    grad_accum: int

    @property
    def name(self) -> str:
        bucket = f"bucket {self.bucket_mb:g} MB" + (" (default)" if self.bucket_mb == DEFAULT_BUCKET_MB else "")
        return bucket if self.grad_accum == 1 else f"{bucket}, grad accum {self.grad_accum}"


def variants(args: OverheadArgs) -> list[Variant]:
    sizes = bucket_sizes(args.bucket_mb)
    return [Variant(size, 1) for size in sizes] + [Variant(sizes[0], args.grad_accum)]


def build(name: str, bucket_mb: float, ctx: DistContext, sync_bn: bool) -> nn.parallel.DistributedDataParallel:
    """The model as experiments.cifar10.build makes it (fp32, no channels_last), with this bucket size."""
    torch.manual_seed(0)  # the same weights for every bucket size (DDP broadcasts rank 0's anyway)
    model = build_model(name)
    if sync_bn and ctx.world_size > 1:
        model = convert_sync_batchnorm(model, ctx.device)  # GlobalBatchNorm on CPU, SyncBatchNorm on CUDA
    model = model.to(ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb)


def make_step(
    model: nn.parallel.DistributedDataParallel, images: torch.Tensor, labels: torch.Tensor, grad_accum: int, sync: bool
) -> Callable[[], None]:
    """One optimizer step: ``grad_accum`` micro-steps, the last one synchronised when ``sync``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)  # one per step function:
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)  # the two sides' momenta must not mix

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for micro in range(grad_accum):
            synced = sync and micro == grad_accum - 1
            with contextlib.nullcontext() if synced else model.no_sync():
                loss = loss_fn(model(images), labels)
                (loss / grad_accum if grad_accum > 1 else loss).backward()
        optimizer.step()

    return step


def bucket_count(model: nn.parallel.DistributedDataParallel) -> int | None:
    """How many gradient buckets DDP reduces now; None where this torch does not say (a private API).

    torch 2.14 reduces the first iteration in one bucket and only then splits the gradients by
    ``bucket_cap_mb``, in the order they became ready: count after a synchronised step.
    """
    try:
        return len(model.reducer._get_zeros_like_grad_buckets())
    except (AttributeError, RuntimeError):
        return None


def measure_model(name: str, ctx: DistContext, args: OverheadArgs) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own batch, as with real data
    images = torch.randn(args.batch_size, 3, 32, 32, generator=generator).to(ctx.device)
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator).to(ctx.device)
    models = {size: build(name, size, ctx, args.sync_bn) for size in bucket_sizes(args.bucket_mb)}
    steps = {
        (v, sync): make_step(models[v.bucket_mb], images, labels, v.grad_accum, sync)
        for v in variants(args)
        for sync in (True, False)
    }
    # Warm-up, both sides of each bucket size once (the accumulation variant shares its model), the DDP
    # step first: DDP rebuilds its buckets (in gradient-ready order, split by bucket_cap_mb) at the forward
    # after its first synchronised backward, so every timed step sees the layout a long run uses.
    for v in variants(args):
        if v.grad_accum == 1:
            for sync in (True, False):
                time_per_call(steps[(v, sync)], 1, ctx.device)
    samples: dict[tuple[Variant, bool], list[float]] = {key: [] for key in steps}
    for _ in range(args.rounds):
        for key, fn in steps.items():
            samples[key].append(time_per_call(fn, args.steps, ctx.device))
    grads_mb = sum(p.numel() * p.element_size() for p in next(iter(models.values())).parameters()) / 2**20
    rows = []
    for v in variants(args):
        ddp_s, local_s = statistics.median(samples[(v, True)]), statistics.median(samples[(v, False)])
        rows.append(
            {
                "model": name,
                "variant": v.name,
                "bucket_cap_mb": v.bucket_mb,
                "grad_accum": v.grad_accum,
                "buckets": bucket_count(models[v.bucket_mb]),
                "gradients_mb": round(grads_mb, 2),
                "ddp_ms": ddp_s * 1e3,
                "no_comm_ms": local_s * 1e3,
                "ratio": ddp_s / local_s,
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"DDP step ÷ the same step under no_sync (no gradient all-reduce): {result['world_size']} processes, "
        f"{result['backend']} on {result['device']}, batch {result['batch_size']} per process per micro-step, "
        f"sync BN {'on' if result['sync_bn'] else 'off'}, {result['threads']} thread(s) per process, "
        f"median of {result['rounds']} rounds x {result['steps']} step(s); torch {result['torch']}",
        "",
        "| model | variant | buckets | DDP ms/step | no-comm ms/step | DDP − no-comm ms | DDP ÷ no-comm |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        model = f"{row['model']} ({row['gradients_mb']:.1f} MB of gradients)"
        buckets = "?" if row["buckets"] is None else str(row["buckets"])
        lines.append(
            f"| {model} | {row['variant']} | {buckets} | {row['ddp_ms']:.1f} | {row['no_comm_ms']:.1f} | "
            f"{row['ddp_ms'] - row['no_comm_ms']:.1f} | {row['ratio']:.2f}× |"
        )
    return "\n".join(lines)


def run(args: OverheadArgs) -> None:
    with process_group(args.dist_config()) as ctx:
        torch.set_num_threads(args.threads)
        rows = [row for name in _names(args.models) for row in measure_model(name, ctx, args)]
        result = {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": ctx.device.type,
            "torch": torch.__version__,
            "batch_size": args.batch_size,
            "rounds": args.rounds,
            "steps": args.steps,
            "threads": args.threads,
            "sync_bn": args.sync_bn,
            "rows": rows,
        }
        print0(json.dumps(result, indent=2) if args.json else "\n" + markdown(result))


main = command_main(OverheadArgs, functools.partial(launch_on_chosen_backend, run), doc=__doc__)


if __name__ == "__main__":
    main.run_and_exit()
