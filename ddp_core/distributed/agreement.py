"""Rank 0 decides, every rank learns: the one way rank 0's work becomes every rank's outcome.

Global rank 0 alone reads and writes the run directory (the manifest, checkpoints, metrics.json, TensorBoard),
so only it can tell that a checkpoint is unusable, that the disk is full or which run to continue. The other
ranks must not wait in their next collective until a timeout: ``rank0_decides`` runs the work on rank 0 and
broadcasts its outcome in the same call, so every rank returns the same value or raises the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from ddp_core.distributed.collectives import broadcast_object
from ddp_core.errors import ConfigError, RunStoppedError
from ddp_core.ranks import on_rank0

T = TypeVar("T")


class RankZeroFailed(RuntimeError):
    """Rank 0 failed unexpectedly during work every rank waited on; its own traceback is the cause."""


def rank0_decides(action: Callable[[], T]) -> T:
    """Collective: global rank 0 runs ``action``; every rank returns its result or raises the same error.

    - a ``ConfigError`` (an unusable checkpoint, a run that cannot be resumed) or a ``RunStoppedError`` (a full
      disk: ``StorageError``) is raised on every rank with its class and its line, which rank 0 alone prints;
    - anything else (a bug) keeps its traceback on rank 0, and the other ranks raise ``RankZeroFailed`` at once.
    The result travels by pickle: keep it to plain values and tensors.
    """

    def attempt() -> tuple[tuple[str, Any], BaseException | None]:
        try:
            return ("ok", action()), None
        except (ConfigError, RunStoppedError) as error:
            return ("agreed", (type(error), str(error))), None
        except BaseException as error:
            return ("failed", f"{type(error).__name__}: {error}"), error

    outcome, own = on_rank0(attempt) or (("ok", None), None)
    kind, value = broadcast_object(outcome)
    if kind == "ok":
        return cast(T, value)
    if kind == "agreed":
        error_type, text = value
        error = error_type(text)
        error.agreed = True  # a ConfigError: printed once (a RunStoppedError always is)
        raise error
    if own is not None:
        raise own
    raise RankZeroFailed(f"rank 0 failed while every rank waited on it ({value}); its traceback says where")
