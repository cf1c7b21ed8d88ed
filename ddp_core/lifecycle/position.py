"""Where a run stands, and where a resumed run continues: the one place the resume position is decided.

The position is the optimizer step (counting those before a resume), the epoch, and how many of the epoch's
samples the whole world has trained on. Every checkpoint holds all three (its ``position`` state). A resume continues
after exactly those samples: ``TrainingLoop.epochs`` hands ``(epoch, consumed)`` to the sampler, whose
``set_epoch`` deals the rest of the epoch's order. At another world size the samples still decide: the step
becomes this world's step at that position, and the first pass over the loader fits the epoch's end to the
batches the sampler has left for this world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Position:
    steps_per_epoch: int
    samples_per_step: int  # the global batch
    step: int = 0  # optimizer steps done, counting those before a resume
    epoch: int = 0  # the epoch being trained
    consumed: int = 0  # samples of this epoch the whole world has trained on
    start: int = 0  # the step this process started from
    epoch_end: int = 0  # the step that ends this epoch
    fit_to_loader: bool = False  # resumed at another world size: the loader knows how many steps the epoch has left

    def state_dict(self) -> dict[str, int]:
        """The checkpoint's ``position`` state."""
        return {"step": self.step, "epoch": self.epoch, "epoch_samples": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.consumed = (int(state[key]) for key in ("step", "epoch", "epoch_samples"))
        self.start = self.step

    def refit(self) -> None:
        """Resumed at another world size: the step this world reaches after the same samples."""
        self.step = self.start = self.epoch * self.steps_per_epoch + self.consumed // self.samples_per_step
        self.fit_to_loader = True

    def begin_epoch(self) -> None:
        self.epoch_end = self.step + self.steps_per_epoch - self.consumed // self.samples_per_step

    def steps_left(self, loader: Any, micro_batches: int) -> int:
        """Optimizer steps left in this epoch, handed out from ``loader`` (``micro_batches`` per step)."""
        if self.fit_to_loader and hasattr(loader, "__len__"):
            left = len(loader) // micro_batches  # what the sampler dealt this world from the epoch's rest
            self.step = self.start = (self.epoch + 1) * self.steps_per_epoch - left
            self.epoch_end = self.step + left
        self.fit_to_loader = False
        return self.epoch_end - self.step

    def advance(self) -> bool:
        """One optimizer step done; True when it ended the epoch (the position is then the next one's start)."""
        self.step += 1
        self.consumed += self.samples_per_step
        if self.step < self.epoch_end:
            return False
        self.end_epoch()
        return True

    def end_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0
