"""What an instrument may watch in a training worker, and nothing by default.

The benchmarks (``bench/``) and the contract's batch trace (``tools/contract_trace.py``) each watch a worker through
one ``Observer``; the loop and the run call it without knowing who listens (with none installed: one ``is None`` per
micro-batch). An instrument runs the experiment as another process, so it installs its observer there by name:
``DDP_LAB_OBSERVERS=module[,module...]`` lists modules, each with a function ``observer()`` that returns an
``Observer`` or None, imported the first time a worker asks (ddp_core imports none of them). This module imports
nothing of ddp_core: every layer may report to it.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable

VARIABLE = "DDP_LAB_OBSERVERS"


class Observer:
    """A worker's events, each doing nothing here: an instrument overrides those it watches."""

    def mark(self, event: str, **fields: Any) -> None:
        """A phase of the worker's life: ``imported``, ``group``, ``loading``, ``loaded`` and ``first_step``
        (with ``step=``)."""

    def run_started(self, run_dir: Path, rank: int) -> None:
        """The loop exists: the run directory it writes and this process's global rank."""

    def batch(self, step: int, batch: Any) -> None:
        """A micro-batch handed to the experiment for optimizer step ``step`` (not a resume's settling pass)."""

    def epoch_trained(self, epoch: int) -> None:
        """Epoch ``epoch`` (1-based)'s training steps are done; the loop's clock is paused."""


class _Each:
    """Several observers as one: each event told to each, in the order installed."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers

    def __getattr__(self, event: str) -> Callable[..., None]:  # Observer's events: mark, run_started, ...
        def tell_each(*args: Any, **fields: Any) -> None:
            for observer in self.observers:
                getattr(observer, event)(*args, **fields)

        return tell_each


_installed: list[Observer] | None = None  # None until the environment's are imported (once per process)


def _from_environment() -> list[Observer]:
    named = [name.strip() for name in os.environ.get(VARIABLE, "").split(",") if name.strip()]
    made = [importlib.import_module(module).observer() for module in named]  # each module's observer(), or None
    return [observer for observer in made if observer is not None]


def current() -> Observer | None:
    """This process's observer (its installed ones as one), None where nothing watches."""
    global _installed
    if _installed is None:
        _installed = _from_environment()
    if not _installed:
        return None
    return _installed[0] if len(_installed) == 1 else _Each(_installed)  # type: ignore[return-value]


def mark(event: str, **fields: Any) -> None:
    """``Observer.mark`` to whoever watches (nothing where nobody does)."""
    observer = current()
    if observer is not None:
        observer.mark(event, **fields)


def env(*modules: str) -> dict[str, str]:
    """The variable that installs ``modules``' observers in a process started with it."""
    return {VARIABLE: ",".join(modules)}
