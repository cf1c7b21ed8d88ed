"""An exponential moving average of the parameters (the buffers stay the model's, as in torch's ``AveragedModel``),
tracked by the run (``run.track("ema", WeightEMA(...))``) and evaluated beside the weights (``evaluate_beside``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddp_core.distributed.group import unwrap


class WeightEMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"an average's decay is between 0 and 1, not {decay}")
        self.decay, self.updates = decay, 0
        named = list(unwrap(model).named_parameters())
        self.names = [name for name, _ in named]
        self.average = [param.detach().clone() for _, param in named]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """After an optimizer step: the average moves ``1 - decay`` of the way to the weights."""
        for average, param in zip(self.average, unwrap(model).parameters()):
            average.lerp_(param.detach(), 1 - self.decay)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "weights": dict(zip(self.names, self.average))}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        for name, average in zip(self.names, self.average):
            average.copy_(state["weights"][name])

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_into(self, model: nn.Module) -> Iterator[None]:
        """``model`` holds the average while inside, its own weights again after (copied back, bit for bit)."""
        params = list(unwrap(model).parameters())
        own = [param.detach().clone() for param in params]
        for param, average in zip(params, self.average):
            param.copy_(average)
        try:
            yield
        finally:
            for param, weights in zip(params, own):
                param.copy_(weights)


@dataclass
class Beside:
    """An evaluation of the weights and one of their average (logged as ``eval/NAME`` and ``eval/ema_NAME``);
    any other attribute is the weights' evaluation's."""

    weights: Any
    average: Any

    def as_metrics(self) -> dict[str, float]:
        return {**_metrics(self.weights), **{f"ema_{name}": value for name, value in _metrics(self.average).items()}}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["weights"], name)


def _metrics(result: Any) -> dict[str, float]:
    return result if isinstance(result, dict) else result.as_metrics()


def evaluate_beside(
    evaluate: Callable[[str, int, Any], Any], ema: WeightEMA | None, model: nn.Module
) -> Callable[[int, Any], Any]:
    """The run's evaluation (its step and writer): ``evaluate("eval", step, writer)`` of the weights and, with an
    average, ``evaluate("eval_ema", step, writer)`` of it too."""
    if ema is None:
        return lambda step, writer: evaluate("eval", step, writer)

    def both(step: int, writer: Any) -> Beside:
        weights = evaluate("eval", step, writer)
        with ema.swapped_into(model):
            return Beside(weights, evaluate("eval_ema", step, writer))

    return both
