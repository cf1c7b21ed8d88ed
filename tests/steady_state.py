"""Watching a run's steady-state steps from inside its process: what the host does while the GPU should run ahead.

``watch_steps(first, last, enter, leave)`` wraps ``TrainingLoop.step`` so that ``enter()`` runs right after
optimizer step ``first - 1`` has been coordinated and ``leave()`` right after step ``last`` has: everything in
between (the batches, forward, backward, the optimizer, the loop's own per-step work) is the steady state of
steps ``first..last``. Pick steps that neither log, evaluate nor checkpoint.

``HostReads`` is a ``TorchFunctionMode`` that records each call which would make the host wait for a GPU had
the tensor been on one (a read of its value, a copy to the host, an output whose size depends on the values),
with the project's call site that made it.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ddp_core.lifecycle.loop import TrainingLoop

REPO = Path(__file__).resolve().parents[1]

# Tensor methods and functions whose result the host needs at once, or whose output size depends on the data.
READS = {
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "nonzero",
    "masked_select",
    "unique",
    "equal",
    "allclose",
}


def _call_site() -> str:
    """The innermost frame of this repository's code (not torch's, not this module's) that made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(REPO) and path != Path(__file__) and ".venv" not in path.parts:
            return f"{path.relative_to(REPO)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        copy_to_host = name == "to" and _to_host(args, kwargs)
        if name in READS or copy_to_host or (name == "__getitem__" and _boolean_index(args)):
            self.calls[name, _call_site()] += 1
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """A blocking copy to the host: ``tensor.to("cpu")``, or ``.to(device)`` from another device to the CPU.
    ``.to(x.device)``-style moves onto the device the run uses are no copy where the tensor is on it already, and a
    non-blocking copy is no read."""
    if kwargs.get("non_blocking"):
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    source = args[0].device if args and isinstance(args[0], torch.Tensor) else None
    if isinstance(target, str):
        return torch.device(target).type == "cpu"
    return isinstance(target, torch.device) and target.type == "cpu" and source is not None and source != target


def _boolean_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


@contextlib.contextmanager
def watch_steps(first: int, last: int, enter: Callable[[], None], leave: Callable[[], None]) -> Iterator[None]:
    """Around a run in this process: ``enter`` once step ``first - 1`` is done, ``leave`` once step ``last`` is."""
    original = TrainingLoop.step
    seen: list[int] = []

    def step(loop: TrainingLoop, *args, **kwargs):
        before = loop.global_step
        try:
            return original(loop, *args, **kwargs)
        finally:
            after = loop.global_step  # the optimizer step just coordinated (unchanged by a resume's replay)
            if after != before and after == first - 1 and not seen:
                seen.append(first)
                enter()
            elif after != before and after == last and seen == [first]:
                leave()
                seen.append(last)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TrainingLoop, "step", step)
        yield
    assert seen == [first, last], f"the run never reached steps {first}..{last} (watched: {seen})"
