"""The toy with dropout whose resume forgets the random state: its dropout masks after a resume are not
the uninterrupted run's.

    python -m tools.contract tests.e2e.contract_forgets_rng --only resume    # must FAIL resume

A negative control for tools.contract. Test code only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import experiments.toy as toy
from ddp_core.training import seed


class DropoutToy(toy.ToyModel):
    """The toy model with dropout after its hidden layer: each step draws from the global torch RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.dropout(self.relu(self.net1(x))))


def keep_this_random_state(streams: seed.RankStreams, state: dict) -> None:
    """The mistake: weights, optimizer and step come back; the random state stays this process's own."""


CONTRACT = dataclasses.replace(toy.CONTRACT, model=lambda config: DropoutToy(), world_size_invariant=False)

if __name__ == "__main__":
    toy.ToyModel = DropoutToy
    seed.RankStreams.load_state_dict = keep_this_random_state  # type: ignore[method-assign]
    toy.main.run_and_exit()
