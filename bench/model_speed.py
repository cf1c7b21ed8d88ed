"""One CIFAR10 training step of each model on CPU, side by side: `python -m bench.model_speed`.

A step is forward, label-smoothed cross-entropy, backward and a Nesterov SGD update on a batch of 32x32
images, in one process with one torch thread (as each of 2 processes under torchrun on 2 cores). The
models alternate round by round; the figure is the median over rounds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from ddp_core.config import option, require
from ddp_core.process.entry import command_main
from experiments.cifar10_models import MODELS, build_model


@dataclass
class ModelBenchArgs:
    batch_size: int = option(32, "images per step")
    rounds: int = option(5, "alternating rounds")
    steps: int = option(3, "steps per model per round")
    threads: int = option(1, "torch intra-op threads")


def seconds_per_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor, steps: int
) -> float:
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    start = time.perf_counter()
    for _ in range(steps):
        loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def run_bench(args: ModelBenchArgs) -> dict[str, float]:
    require(min(args.batch_size, args.rounds, args.steps, args.threads) >= 1, "every option must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    images, labels = torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,))
    setups = {}
    for name in MODELS:
        model = build_model(name)
        setups[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True))
        seconds_per_step(*setups[name], images, labels, 1)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (model, optimizer) in setups.items():
            samples[name].append(seconds_per_step(model, optimizer, images, labels, args.steps))
    print(f"\nCIFAR10 training step, CPU, batch {args.batch_size}, {args.threads} torch thread(s), one process")
    result = {}
    for name, values in samples.items():
        seconds = statistics.median(values)
        result[name] = args.batch_size / seconds
        params = sum(p.numel() for p in setups[name][0].parameters()) / 1e6
        print(f"   {name:10s} {params:5.2f} M parameters  {seconds * 1e3:8.1f} ms/step  {result[name]:8.0f} images/s")
    return result


main = command_main(ModelBenchArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
