"""DDP's gradient-bucket layout settled on a resume: the first optimizer step runs twice, once undone so DDP
rebuilds its buckets in gradient-ready order, as the uninterrupted run did (docs/decisions.md, "Resume")."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from ddp_core.training.seed import get_rng_state, set_rng_state

log = logging.getLogger(__name__)
T = TypeVar("T")


def rebuilds_buckets(model: nn.Module, world_size: int, stateful_hook: bool = False) -> bool:
    """Whether DDP will rebuild ``model``'s buckets after its next backward where the layout matters: 3 or more
    ranks (a + b = b + a), or a hook with per-bucket state (PowerSGD) at any world size."""
    if not isinstance(model, nn.parallel.DistributedDataParallel) or model._has_rebuilt_buckets:
        return False
    if model.find_unused_parameters and not model.static_graph:
        return False
    return world_size >= 3 or stateful_hook


class FirstStepReplay:
    """The first optimizer step after a resume, run twice: once to settle DDP's buckets (``undo`` puts back every
    named state), then for real. While ``active`` (the first pass), the run counts nothing."""

    def __init__(
        self,
        model: nn.parallel.DistributedDataParallel,
        undo: Callable[[], None],
        first_pass: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.model, self.undo, self.first_pass = model, undo, first_pass  # first_pass: around the undone step
        self.active = False

    def batches(self, batches: Iterator[T], per_step: int) -> Iterator[T]:
        """``batches`` with the first ``per_step`` (one optimizer step's micro-batches) yielded twice."""
        batches = iter(batches)
        first: list[tuple[T, dict]] = []
        started = time.perf_counter()
        self.active = True
        with self.first_pass():  # e.g. a communication hook kept from touching its state
            for batch in batches:
                first.append((batch, get_rng_state()))  # the streams as they are once this batch is drawn
                yield batch
                if len(first) == per_step:
                    break
        self.active = False
        if len(first) < per_step:
            return  # the epoch ended inside the step: nothing to replay
        # DDP has recorded the gradient-ready order: its next forward rebuilds the buckets (DDP does it itself).
        self.undo()
        for parameter in self.model.parameters():
            parameter.grad = None  # as the checkpoint left them: no gradient yet
        if next(self.model.parameters()).is_cuda:
            torch.cuda.synchronize()  # once per resume: the time logged is the step's, not its launch's
        settled_ms = 1000 * (time.perf_counter() - started)
        for index, (batch, streams) in enumerate(first):
            set_rng_state(streams)
            yield batch
            if index == 0:  # the real step's first forward has run: DDP rebuilt its buckets there, or did not
                self._report(settled_ms)
        yield from batches

    def _report(self, settled_ms: float) -> None:
        if self.model._has_rebuilt_buckets:
            log.info(
                "DDP's gradient buckets settled in %.0f ms (the first step run once and undone, so the resume is "
                "bitwise)",
                settled_ms,
            )
        else:
            log.warning(
                "DDP did not rebuild its gradient buckets: with 3 or more processes this resume may differ from "
                "an uninterrupted run in the last bits"
            )
