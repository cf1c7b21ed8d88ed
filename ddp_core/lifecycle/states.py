"""A checkpoint's named states: each part with state says how its state spreads over the ranks; the checkpointer
gathers and restores them by name, and the file (``output/checkpoint.py``) holds them without looking inside.

A part with state implements ``state_dict()`` and ``load_state_dict(state)``, in tensors and plain Python types
(a checkpoint loads with ``torch.load(weights_only=True)``). Its kind says whose state is saved:

- ``REPLICATED`` (the default): the same on every rank. Rank 0's is saved; every rank loads it, at any world size.
  A tracked object's replicated state is compared across the ranks with the model's (``training/replicas.py``).
- ``PER_RANK``: each rank's own (the RNG streams, PowerSGD's error feedback). Saved as a list by rank; rank r loads
  old rank r's at the same world size. At another world size no rank loads any: each keeps the state it started
  the run with (docs/decisions.md, "Per-rank state at another world size").
- ``SHARDED``: each rank holds a share of one whole (ZeRO's optimizer state). The shares are gathered on rank 0
  and joined (the part's ``join(shares)``); every rank loads the whole, at any world size.

The project's own names: ``model``, ``optimizer``, ``position``, ``rng``, ``grad_scaler``, ``comm_hook``,
``metrics``; an experiment adds its own with ``run.track(name, obj)``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from torch import nn

from ddp_core.distributed.group import unwrap
from ddp_core.errors import AgreedConfigError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP, torch.compile
PROJECT_STATES = ("model", "optimizer", "position", "rng", "grad_scaler", "comm_hook", "metrics")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class Kind(Enum):
    REPLICATED = "replicated"
    PER_RANK = "per rank"
    SHARDED = "sharded"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


@dataclass(frozen=True)
class Named:
    name: str
    part: Any  # Stateful; a SHARDED one also has join(shares) -> whole
    kind: Kind = Kind.REPLICATED
    tracked: bool = False  # the experiment's own (run.track), not the project's


class NamedStates:
    """The parts a checkpoint holds, by name, in the order they were added (the order they are restored in)."""

    def __init__(self) -> None:
        self._parts: dict[str, Named] = {}

    def add(self, name: str, part: Any, kind: Kind = Kind.REPLICATED, *, tracked: bool = False) -> None:
        where = f"run.track({name!r}, ...)" if tracked else f"the {name!r} state"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise AgreedConfigError(f"{where}: a name is letters, digits, '_', '.' or '-', not starting with a digit")
        if name in self._parts or (tracked and name in PROJECT_STATES):
            raise AgreedConfigError(f"{where}: the name {name!r} is taken: choose another")
        if not isinstance(part, Stateful):
            raise AgreedConfigError(f"{where}: a {type(part).__name__} has no state_dict() and load_state_dict(state)")
        self._parts[name] = Named(name, part, kind, tracked)

    def __iter__(self) -> Iterator[Named]:
        return iter(list(self._parts.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def of(self, kind: Kind) -> list[Named]:
        return [named for named in self if named.kind is kind]


def load_copy(part: Any, state: Any) -> None:
    """``part.load_state_dict`` with a copy: a state loaded as it is could be changed in place by the next step,
    and a resume's replay loads the checkpoint twice (``training/buckets.py``)."""
    part.load_state_dict(copy.deepcopy(state))


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop the wrapper prefixes DDP and torch.compile add to every key (a state dict a script of one's own saved
    from the wrapped model has them; ddp-lab's checkpoints never do)."""
    clean = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        clean[key] = value
    return clean


def load_model_state(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Load weights saved from a plain, DDP-wrapped or compiled model into any of them."""
    target = unwrap(model)
    if set(state_dict) != set(target.state_dict()):  # a state dict saved from the wrapper (a child named
        state_dict = strip_prefixes(state_dict)  # `module` must keep its name, so strip only on mismatch)
    target.load_state_dict(state_dict)


class ModelState:
    """The model's weights without DDP's ``module.`` or torch.compile's prefixes: they load into the plain model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return unwrap(self.model).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_model_state(self.model, state)
