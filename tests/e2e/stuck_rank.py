"""The toy experiment with one rank stuck in user code, for the hang report's tests (tests/e2e/test_hang_stacks.py).

    python -m ddp_core.torchrun --standalone --nproc-per-node=3 -m tests.e2e.stuck_rank [toy's flags]

STUCK=hook: rank STUCK_RANK sleeps for good in an optimizer step hook after its STUCK_STEP-th step (the others
wait in the next collective). STUCK=loader: the batches come from a DataLoader with one worker process, and on rank
STUCK_RANK that worker sleeps for good in ``__getitem__`` at the STUCK_STEP-th batch of an epoch (the rank waits on it).
"""

from __future__ import annotations

import os
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_core.experiment import TrainingRun, experiment_main
from ddp_core.training.samplers import TrainSampler
from experiments.toy import ToyArgs, ToyModel, make_dataset

STUCK, RANK, STEP = os.environ.get("STUCK", ""), int(os.environ.get("STUCK_RANK", "1")), int(os.environ["STUCK_STEP"])


def sleep_in_the_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    sleep_in_the_hook.steps = getattr(sleep_in_the_hook, "steps", 0) + 1  # type: ignore[attr-defined]
    if sleep_in_the_hook.steps == STEP:  # type: ignore[attr-defined]
        threading.Event().wait()  # the fault itself: this rank never comes back


class StuckData(Dataset):
    """Toy's samples; the loader's worker on the stuck rank stops at the STUCK_STEP-th batch's first sample."""

    def __init__(self, size: int, seed: int, batch_size: int, rank: int) -> None:
        self.data, self.batch_size, self.rank, self.served = make_dataset(size, seed), batch_size, rank, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.served += 1  # counted in the worker process, which serves every sample of this rank
        if STUCK == "loader" and self.rank == RANK and self.served > (STEP - 1) * self.batch_size:
            threading.Event().wait()  # the fault itself: a read that never returns
        return self.data[index]


def train(run: TrainingRun, args: ToyArgs) -> dict[str, float]:
    model = run.wrap(ToyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    if STUCK == "hook" and run.rank == RANK:
        optimizer.register_step_post_hook(sleep_in_the_hook)
    dataset = StuckData(args.dataset_size, args.seed, args.batch_size, run.rank)
    sampler = TrainSampler(len(dataset), run.rank, run.world_size, seed=args.seed)
    workers = 1 if STUCK == "loader" else 0
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, drop_last=True, num_workers=workers)
    plan = run.plan(loader, total_steps=args.steps)
    loop = plan.resume_or_start(model, optimizer)
    for epoch, consumed in loop.epochs():
        sampler.set_epoch(epoch, consumed=consumed)
        for micro_batches in loop.steps(loader):
            for inputs, targets in micro_batches:
                loop.backward(nn.functional.mse_loss(model(inputs.to(run.device)), targets.to(run.device)))
            loop.optimizer.step()
            loop.optimizer.zero_grad(set_to_none=True)
            if loop.step():
                break
    return loop.finish()


main = experiment_main("stuck_rank", ToyArgs, train, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
