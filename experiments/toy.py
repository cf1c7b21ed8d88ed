"""The PyTorch DDP tutorial's ToyModel (Linear 10->10, ReLU, Linear 10->5) on a synthetic regression task.

Launch (every command from the repository root; docs/clusters.md for several hosts):

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.toy   # 2 processes, one machine
    python -m experiments.toy --nproc 2           # no torchrun: torch.multiprocessing (no --nproc: a world of one)

    # two nodes, 2 processes each, elastic (c10d) rendezvous: the same command on every node
    python -m ddp_core.torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=NODE0 \\
        --rdzv-id=toy1 -m experiments.toy

    # stop at step 120 of 200 (a checkpoint, no metrics.json), then continue it (same number of processes)
    export RUN_DIR=runs/toy/try1
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.toy --stop-at-step 120
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.toy --resume

With the same global batch (--batch-size x processes) and seed, 1, 2 and 4 processes end with the same
weights up to float32 rounding: the training sampler hands out the same global batch at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_core.config import option, require
from ddp_core.contract_spec import ContractSpec
from ddp_core.experiment import StepsArgs, TrainingArgs, TrainingRun, experiment_main
from ddp_core.training.samplers import TrainSampler


@dataclass
class ToyArgs(StepsArgs, TrainingArgs):
    batch_size: int = option(
        32, "samples per process per step (x processes: the global batch)", minimum=1, maximum=10**7
    )
    lr: float = option(0.2, "SGD learning rate", above=0)
    dataset_size: int = option(4096, "synthetic samples, held by every rank (60 bytes each)", minimum=1, maximum=10**7)
    steps: int = 200  # shared options (their help: --help), with this experiment's defaults
    checkpoint_every: int = 50
    log_every: int = 20


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


# What `python -m tools.contract experiments.toy` needs beyond the flags (ddp_core/contract_spec.py).
CONTRACT = ContractSpec(
    model=lambda config: ToyModel(),
    brief=("--steps", "12", "--checkpoint-every", "4", "--log-every", "4", "--dataset-size", "512"),
    stop_at_step=5,
    long=("--steps", "1000000", "--checkpoint-every", "5", "--dataset-size", "512"),
    world_size_invariant=True,  # the sampler deals the same global batch at every step (docstring)
)


def make_dataset(size: int, seed: int) -> TensorDataset:
    """Inputs and targets from a fixed random teacher network plus noise; identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 10, generator=generator)
    teacher_hidden = torch.randn(10, 10, generator=generator) / 10**0.5
    teacher_out = torch.randn(10, 5, generator=generator) / 10**0.5
    targets = torch.relu(inputs @ teacher_hidden) @ teacher_out + 0.05 * torch.randn(size, 5, generator=generator)
    return TensorDataset(inputs, targets)


def validate(args: ToyArgs) -> None:
    """Each option's own range is declared above; here what spans several options, before any process starts."""
    batch, size = args.batch_size, args.dataset_size
    require(batch <= size, f"--batch-size={batch} is larger than --dataset-size={size}: it must be at most that")


def train(run: TrainingRun, args: ToyArgs) -> dict[str, float]:
    model = run.wrap(ToyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset = make_dataset(args.dataset_size, args.seed)
    sampler = TrainSampler(len(dataset), run.rank, run.world_size, seed=args.seed)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, drop_last=True, generator=run.loader_generator())
    loss_fn = nn.MSELoss()
    plan = run.plan(loader, total_steps=args.steps)  # the epoch's length and the batch: the loader's
    loop = plan.resume_or_start(model, optimizer)  # a checkpoint's state, or fresh per-rank streams
    optimizer = loop.optimizer  # under --zero: the sharded one
    for epoch, consumed in loop.epochs():
        sampler.set_epoch(epoch, consumed=consumed)  # a resumed epoch continues where it stopped
        for micro_batches in loop.steps(loader):  # an optimizer step: --grad-accum micro-batches (default 1)
            for inputs, targets in micro_batches:  # DDP all-reduces (averages) the gradients on the last one
                loop.backward(loss_fn(model(inputs.to(run.device)), targets.to(run.device)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if loop.step():
                break
    return loop.finish()


main = experiment_main("toy", ToyArgs, train, doc=__doc__, validate=validate, headline=("final_loss",))

if __name__ == "__main__":
    main.run_and_exit()
