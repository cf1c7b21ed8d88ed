"""Check that every rank still holds the same model: fingerprints of every tensor DDP keeps equal and of each
tracked replicated state, gathered in one collective; ``ReplicasDivergedError`` on every rank names the first
that differs."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.distributed.sync_batchnorm import GlobalBatchNorm
from ddp_core.errors import RunStoppedError
from ddp_core.exit_codes import REPLICAS_DIVERGED_EXIT_CODE

_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDivergedError(RunStoppedError):
    """The ranks' models differ; the message names the tensor, the ranks and the last step that agreed."""

    exit_code = REPLICAS_DIVERGED_EXIT_CODE


def compared_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of what DDP keeps equal: every parameter and buffer but a plain batch norm's running
    statistics (each rank's own until DDP's next broadcast)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    local = set()
    for prefix, module in inner.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
            module, (nn.SyncBatchNorm, GlobalBatchNorm)
        ):
            local |= {f"{prefix}.{name}" if prefix else name for name in ("running_mean", "running_var")}
    return [*inner.named_parameters(), *((name, buffer) for name, buffer in inner.named_buffers() if name not in local)]


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bits (plain, and weighted by position), computed on its device."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_AS_INTEGERS[flat.element_size()]).to(torch.int64)  # integer sums wrap around: exact, any order
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
    return torch.stack([bits.sum(), (bits * weights).sum()])


def state_fingerprint(state: Any, device: torch.device) -> torch.Tensor:
    """Two int64 for a whole state dict (its tensors' fingerprints and a hash of its plain values and layout): the
    same size on every rank, so a rank with another layout is named, not a collective of mismatched shapes."""
    total = torch.zeros(2, dtype=torch.int64, device=device)
    plain: list[Any] = []

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            plain.append(("tensor", tuple(value.shape), str(value.dtype)))
            total = total + len(plain) * fingerprint(value).to(device)  # int64 sums wrap: exact in any order
        elif isinstance(value, dict):
            plain.append(("dict", len(value)))
            for key, item in value.items():
                plain.append(key)
                walk(item)
        elif isinstance(value, (list, tuple)):
            plain.append(("list", len(value)))
            for item in value:
                walk(item)
        else:
            plain.append(value)

    walk(state)
    digest = hashlib.blake2b(pickle.dumps(plain), digest_size=16).digest()
    halves = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]
    return total + torch.tensor(halves, dtype=torch.int64, device=device)


class ReplicaCheck:
    """Compares the ranks' models and tracked replicated objects at a step; remembers the last step that agreed."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.named, self.device = compared_tensors(model), device
        self.last_agreed: int | None = None
        self.tracked: list[tuple[str, Any]] = []  # (name, object with state_dict()): run.track's replicated ones

    def track(self, name: str, part: Any) -> None:
        self.tracked.append((name, part))

    def check(self, step: int, kept: Callable[[], Path] | None = None) -> None:
        """Collective: raises ReplicasDivergedError on every rank if any fingerprint differs; ``kept`` (called only
        then) gives the checkpoint to name for a resume."""
        if not (dist.is_initialized() and dist.get_world_size() > 1) or not (self.named or self.tracked):
            self.last_agreed = step
            return
        mine = [fingerprint(tensor).to(self.device) for _, tensor in self.named]
        mine += [state_fingerprint(part.state_dict(), self.device) for _, part in self.tracked]
        local = torch.stack(mine)
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        table = torch.stack(rows).cpu()  # (ranks, tensors, 2): the one host read
        names = [name for name, _ in self.named] + [f"{name} (tracked, replicated)" for name, _ in self.tracked]
        problem = disagreement(table, names)
        if problem is None:
            self.last_agreed = step
            return
        since = "no check had agreed yet"
        if self.last_agreed is not None:
            since = f"the last check that agreed was at step {self.last_agreed}"
        checkpoint, resume = kept() if kept is not None else None, "no checkpoint had been written yet"
        if checkpoint is not None and checkpoint.is_file():
            resume = f"--resume continues from {checkpoint}"
        raise ReplicasDivergedError(
            f"replicas diverged at step {step}: {problem}; {since}, and nothing was saved since: {resume}. "
            "Causes: a rank that skipped an update, a kernel that is not deterministic (--deterministic rules it out), "
            "a buffer no collective synchronises, a tracked object each rank holds its own of (track it with "
            "per_rank=True), a faulty GPU (the same rank again)"
        )


def disagreement(table: torch.Tensor, names: list[str]) -> str | None:
    """None if every rank's (tensors, 2) fingerprints agree; else the first differing tensor and who differs (those
    outside the largest agreeing group, or every group when none is larger)."""
    differs = (table != table[0]).any(dim=2).any(dim=0)
    if not differs.any():
        return None
    first = int(differs.nonzero()[0])
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(table.shape[0]):
        groups.setdefault(tuple(table[rank, first].tolist()), []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    if len(ordered[0]) > len(ordered[1]):
        odd = sorted(rank for ranks in ordered[1:] for rank in ranks)
        who = f"rank(s) {', '.join(map(str, odd))} differ from rank(s) {', '.join(map(str, ordered[0]))}"
    else:
        who = "ranks " + " vs ".join(", ".join(map(str, ranks)) for ranks in ordered) + " disagree, with no majority"
    more = int(differs.sum()) - 1
    return f"{names[first]}: {who}" + (f" ({more} more tensor(s) differ)" if more else "")
