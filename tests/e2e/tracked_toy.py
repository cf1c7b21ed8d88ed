"""The toy with two objects of its own in the checkpoint (``run.track``), written apart from ddp-lab's parts:

- ``drift``, replicated: a running mean of the weights, a step count and a python float, the same on every rank;
- ``tally``, per rank: what this rank's batches summed to, and how many it saw (each rank's own).

    torchrun ... -m tests.e2e.tracked_toy [toy flags]   (TRACKED_TOY_SKIP=tally: track drift alone;
                                                         TRACKED_TOY_SKEW_RANK=1: that rank's drift differs)

Test code only: tests/e2e/test_tracked_state.py resumes it bitwise at 2 and 3 processes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_core.experiment import TrainingRun, experiment_main
from ddp_core.training.samplers import TrainSampler
from experiments.toy import CONTRACT, ToyArgs, ToyModel, make_dataset, validate  # noqa: F401 (CONTRACT: the toy's)


class Drift:
    """A running mean of the weights: replicated, since every rank holds the same weights."""

    def __init__(self, model: nn.Module) -> None:
        self.mean = [p.detach().clone() for p in model.parameters()]
        self.count, self.last_norm = 0, 0.0

    def update(self, model: nn.Module) -> None:
        self.count += 1
        with torch.no_grad():
            for mean, p in zip(self.mean, model.parameters()):
                mean.add_(p - mean, alpha=1 / self.count)
        self.last_norm = float(sum(m.norm() for m in self.mean))

    def state_dict(self) -> dict[str, Any]:
        return {"mean": [m.clone() for m in self.mean], "count": self.count, "last_norm": self.last_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = [m.clone() for m in state["mean"]]
        self.count, self.last_norm = state["count"], state["last_norm"]


class Tally:
    """What this rank's batches summed to: each rank's own."""

    def __init__(self) -> None:
        self.total, self.batches = torch.zeros(10, dtype=torch.float64), 0

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.clone(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.batches = state["total"].clone(), state["batches"]


def train(run: TrainingRun, args: ToyArgs) -> dict[str, float]:
    model = run.wrap(ToyModel())
    drift, tally = run.track("drift", Drift(model)), Tally()
    if os.environ.get("TRACKED_TOY_SKIP") != "tally":
        run.track("tally", tally, per_rank=True)
    skew = os.environ.get("TRACKED_TOY_SKEW_RANK")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset = make_dataset(args.dataset_size, args.seed)
    sampler = TrainSampler(len(dataset), run.rank, run.world_size, seed=args.seed)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, drop_last=True, generator=run.loader_generator())
    loop = run.plan(loader, total_steps=args.steps).resume_or_start(model, optimizer)
    for epoch, consumed in loop.epochs():
        sampler.set_epoch(epoch, consumed=consumed)
        for micro_batches in loop.steps(loader):
            for inputs, targets in micro_batches:
                tally.total += inputs.sum(dim=0, dtype=torch.float64)
                tally.batches += 1
                loop.backward(nn.functional.mse_loss(model(inputs), targets))
            loop.optimizer.step()
            loop.optimizer.zero_grad(set_to_none=True)
            drift.update(model)
            if skew is not None and run.rank == int(skew):
                drift.last_norm += 1e-9  # a replicated state that differs on one rank: the replica check's to catch
            if loop.step():
                break
    return loop.finish()


main = experiment_main("tracked_toy", ToyArgs, train, doc=__doc__, validate=validate)

if __name__ == "__main__":
    main.run_and_exit()
