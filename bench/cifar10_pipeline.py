"""CIFAR10 input pipelines side by side on CPU: the resident tensor path vs the textbook torchvision path.

`python -m bench.cifar10_pipeline` (one process; no files: a synthetic uint8 dataset in memory).

Both produce the same training batches (same sampler shard; random crop with 4 pixels of zero padding,
horizontal flip, normalisation; float32 NCHW + int64 labels). Each round runs one full epoch of each
pipeline, alternating (tensor, torchvision, tensor, ...), so machine noise hits both alike; the figure
reported is the median images/s over rounds, and the ratio is of the medians. By default torch uses one
thread, as each process does under ``torchrun --nproc-per-node=2`` (torchrun sets OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from ddp_core.config import option, require
from ddp_core.process.entry import command_main
from ddp_core.training.samplers import TrainSampler
from experiments.cifar10_data import Split, train_loader


@dataclass
class PipelineBenchArgs:
    images: int = option(10_000, "synthetic training images held in memory")
    batch_size: int = option(256, "images per batch")
    rounds: int = option(7, "alternating rounds; each round is one epoch of each pipeline")
    threads: int = option(1, "torch intra-op threads (1: as under torchrun with 2 processes on 2 cores)")
    num_workers: int = option(0, "DataLoader workers of the torchvision pipeline (2 were no faster on 2 cores)")


def images_per_second(loader: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """(images/s, batches) of one full pass; a pass also advances the sampler to its next epoch."""
    start, images, batches = time.perf_counter(), 0, 0
    for x, _ in loader:
        images += len(x)
        batches += 1
    return images / (time.perf_counter() - start), batches


def compare(args: PipelineBenchArgs) -> dict[str, float]:
    """Median images/s of each pipeline over alternating epochs."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.images, 32, 32, 3), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (args.images,), generator=generator)
    loaders = {}
    for pipeline in ("tensor", "torchvision"):
        sampler = TrainSampler(args.images, rank=0, world_size=1, seed=0)
        loaders[pipeline] = train_loader(
            Split(images, labels), sampler, args.batch_size, pipeline, "cpu", num_workers=args.num_workers
        )
    samples: dict[str, list[float]] = {name: [] for name in loaders}
    total_batches = dict.fromkeys(loaders, 0)
    for loader in loaders.values():  # warm-up: first-call costs, imports, worker start
        images_per_second(loader)
    for _ in range(args.rounds):
        for name, loader in loaders.items():
            rate, batches = images_per_second(loader)
            samples[name].append(rate)
            total_batches[name] += batches
    print(f"   batches timed per pipeline: {total_batches['tensor']} (batch {args.batch_size})")
    return {name: statistics.median(rates) for name, rates in samples.items()}


def run_bench(args: PipelineBenchArgs) -> dict[str, float]:
    require(
        args.images >= args.batch_size >= 1, f"--images={args.images} must be >= --batch-size={args.batch_size} >= 1"
    )
    require(
        args.rounds >= 1 and args.threads >= 1 and args.num_workers >= 0,
        "--rounds and --threads must be >= 1, --num-workers >= 0",
    )
    torch.set_num_threads(args.threads)
    print(
        f"\nCIFAR10 input pipeline, CPU, {args.images} images in memory, batch {args.batch_size}, "
        f"{args.threads} torch thread(s), torchvision DataLoader workers: {args.num_workers}"
    )
    result = compare(args)
    tensor, textbook = result["tensor"], result["torchvision"]
    print(f"   {'tensor (resident, batched ops)':40s} {tensor:10,.0f} images/s")
    print(f"   {'torchvision (Dataset/DataLoader/PIL)':40s} {textbook:10,.0f} images/s")
    print(f"   tensor / torchvision: {tensor / textbook:.1f}x  (median of {args.rounds} alternating epochs each)")
    return {"tensor_images_per_s": tensor, "torchvision_images_per_s": textbook, "ratio": tensor / textbook}


main = command_main(PipelineBenchArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
