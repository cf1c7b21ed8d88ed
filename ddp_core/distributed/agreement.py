"""Rank 0 decides, every rank learns: rank 0's work and its outcome reach every rank in one call, so none waits
for a timeout (docs/decisions.md, "Process group")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

from ddp_core.distributed.collectives import broadcast_object
from ddp_core.distributed.env import joining
from ddp_core.errors import ConfigError, RunStoppedError
from ddp_core.ranks import on_rank0

T = TypeVar("T")


class RankZeroFailed(RuntimeError):
    """Rank 0 failed unexpectedly during work every rank waited on; its own traceback is the cause."""


def rank0_decides(action: Callable[[], T]) -> T:
    """Collective: global rank 0 runs ``action``; every rank returns its (pickled) result, or raises the same
    ConfigError / RunStoppedError; after another error rank 0 keeps its traceback, the others raise RankZeroFailed."""

    def attempt() -> tuple[tuple[str, Any], BaseException | None]:
        try:
            return ("ok", action()), None
        except (ConfigError, RunStoppedError) as error:
            return ("agreed", (type(error), str(error))), None
        except BaseException as error:
            return ("failed", f"{type(error).__name__}: {error}"), error

    if joining() and not dist.is_initialized():  # a --heal replacement's set-up: its peers are training
        (kind, value), own = attempt()
    else:
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
