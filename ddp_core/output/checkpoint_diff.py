"""Whether two runs ended in the same state, bit for bit: their last checkpoints compared named state by named
state (model, optimizer, position, rng, tracked objects, ...), each tensor by its bytes.

``python -m ddp_core.runs --same A B`` prints ``same_states``'s lines; the runs table imports this module only
then, since it needs torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_core.errors import ConfigError
from ddp_core.output.checkpoint import CheckpointDir, check_format, load_checkpoint, named_states


@dataclass(frozen=True)
class Difference:
    where: str  # "net.0.weight", "[1].cpu", "step": the path inside the state
    what: str  # how it differs, in words


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bytes is bitwise equality, NaNs and signed zeros included."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def _value(element: torch.Tensor) -> str:
    value = element.item()
    return f"{value:.9g}" if isinstance(value, float) else repr(value)  # float32's digits, not float64's


def _tensors(a: torch.Tensor, b: torch.Tensor, where: str) -> Difference | None:
    """None where ``a`` and ``b`` have the same bytes; else how many elements differ and where the most."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return Difference(where, f"{a.dtype} {list(a.shape)} in A, {b.dtype} {list(b.shape)} in B")
    bytes_a, bytes_b = _bytes(a), _bytes(b)
    if torch.equal(bytes_a, bytes_b):
        return None
    differs = (bytes_a != bytes_b).reshape(a.numel(), -1).any(dim=1)  # by element
    wide = torch.complex128 if a.is_complex() else torch.float64
    flat_a, flat_b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    gap = (flat_a.to(wide) - flat_b.to(wide)).abs()
    gap = torch.where(differs, gap.nan_to_num(nan=math.inf), torch.zeros_like(gap))  # a NaN's difference: the most
    at = int(gap.argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(at), a.shape)] if a.dim() else []
    about = (
        f"{a.dtype} {list(a.shape)}: {int(differs.sum())} of {a.numel()} elements differ, the largest by "
        f"{gap[at].item():.6g} (at {index}: {_value(flat_a[at])} in A, {_value(flat_b[at])} in B)"
    )
    return Difference(where, about)


def _same_plain(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    return type(a) is type(b) and a == b


def first_difference(a: Any, b: Any, where: str = "") -> Difference | None:
    """The first place where ``a`` and ``b`` differ, in ``a``'s order (None: bitwise equal)."""
    here = where or "(the whole state)"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return Difference(here, f"{type(a).__name__} in A, {type(b).__name__} in B")
        return _tensors(a, b, here)
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(key for key in b if key not in a)]:
            inner = f"{where}.{key}" if where else str(key)
            if key not in a or key not in b:
                return Difference(inner, f"only in {'A' if key in a else 'B'}")
            found = first_difference(a[key], b[key], inner)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return Difference(here, f"{len(a)} items in A, {len(b)} in B")
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if _same_plain(a, b) else Difference(here, f"{a!r} in A, {b!r} in B")


def last_checkpoint(run_dir: Path, label: str) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint of the run in ``run_dir`` and its contents; ConfigError if it has none."""
    path = CheckpointDir.of_run(run_dir).newest()
    if path is None:
        raise ConfigError(f"--same {label}: the run has no checkpoint to compare (checkpoints/ holds none)")
    checkpoint = load_checkpoint(path)
    check_format(checkpoint)
    return path, checkpoint


def same_states(run_a: Path, run_b: Path, labels: tuple[str, str]) -> tuple[bool, list[str]]:
    """Whether the two runs' last checkpoints hold bitwise-equal named states, and the lines that say so."""
    (path_a, a), (path_b, b) = last_checkpoint(run_a, labels[0]), last_checkpoint(run_b, labels[1])
    states_a, states_b = named_states(a), named_states(b)
    steps = f"step {a['step']}" if a["step"] == b["step"] else f"steps {a['step']} and {b['step']}"
    names = [*states_a, *(name for name in states_b if name not in states_a)]
    differing = []
    first: tuple[str, Difference] | None = None
    for name in names:
        if name not in states_a or name not in states_b:
            found: Difference | None = Difference("", f"a state only in {'A' if name in states_a else 'B'}")
        else:
            found = first_difference(states_a[name], states_b[name])
        if found:
            differing.append(name)
            first = first or (name, found)
    if first is None:
        return True, [
            f"the same: the last checkpoints ({steps}) are bitwise equal in {len(names)} states: " + ", ".join(names)
        ]
    name, difference = first
    where = f", {difference.where}" if difference.where else ""
    return False, [
        f"different: the last checkpoints ({steps}) differ in {len(differing)} of {len(names)} states: "
        + ", ".join(differing),
        f"  first: state {name!r}{where}: {difference.what}",
        f"  A: {path_a}",
        f"  B: {path_b}",
    ]
