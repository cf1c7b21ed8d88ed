"""Check that every rank still holds the same model: DDP keeps replicas equal only as long as nothing breaks it.

A rank that skipped an update, a non-deterministic kernel, an unsynchronised buffer or a faulty GPU makes
replicas drift apart while the loss still looks fine. ``ReplicaCheck.check(step)`` fingerprints every
parameter and every buffer DDP keeps equal, on the device (two int64 sums of each tensor's bits: a plain
one and one weighted by position, so a change of any element, or a swap of two, changes it), gathers the
fingerprints of every rank in one collective, and raises ``ReplicasDivergedError`` on every rank at the
same step when they differ, naming the first differing tensor, the ranks that disagree and the last step
whose check agreed. Called every ``--check-replicas-every`` steps and before every checkpoint, so a
checkpoint is always of agreeing replicas.

Not compared: buffers a forward pass updates from the rank's own batch, which DDP re-synchronises only at
the start of the next forward (the running statistics of a plain, non-synchronized batch norm).
"""

from __future__ import annotations

from pathlib import Path

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
    """``(name, tensor)`` of what DDP keeps equal on every rank: every parameter, and every buffer except a
    plain batch norm's running statistics (each rank updates them from its own batch; DDP broadcasts rank
    0's at the start of the next forward)."""
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


class ReplicaCheck:
    """Compares the ranks' models at a step; remembers the last step that agreed."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.named = compared_tensors(model)
        self.device = device
        self.last_agreed: int | None = None

    def check(self, step: int, checkpoint: Path | None = None) -> None:
        """Collective (one all_gather of 2 int64 per tensor). Raises ReplicasDivergedError on every rank if any
        rank's fingerprint of any tensor differs; ``checkpoint``, where it exists, is named as the one to resume."""
        if not (dist.is_initialized() and dist.get_world_size() > 1) or not self.named:
            self.last_agreed = step
            return
        local = torch.stack([fingerprint(tensor) for _, tensor in self.named]).to(self.device)
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        table = torch.stack(rows).cpu()  # (ranks, tensors, 2): the one host read
        problem = disagreement(table, [name for name, _ in self.named])
        if problem is None:
            self.last_agreed = step
            return
        since = (
            f"the last check that agreed was at step {self.last_agreed}"
            if self.last_agreed is not None
            else "no check had agreed yet"
        )
        kept = (
            f"--resume continues from {checkpoint}"
            if checkpoint is not None and checkpoint.is_file()
            else "no checkpoint had been written yet"
        )
        raise ReplicasDivergedError(
            f"replicas diverged at step {step}: {problem}; {since}, and nothing was saved since: {kept}. "
            "Causes: a rank that skipped an update, a kernel that is not deterministic (--deterministic rules it out), "
            "a buffer no collective synchronises, a faulty GPU (the same rank again)"
        )


def disagreement(table: torch.Tensor, names: list[str]) -> str | None:
    """``table``: (ranks, tensors, 2) fingerprints. None if every rank agrees; else the first differing tensor
    and who differs: the ranks outside the largest group that agrees, or every group when none is larger."""
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
        who = f"rank(s) {_ranks(odd)} differ from rank(s) {_ranks(ordered[0])}"
    else:
        who = "ranks " + " vs ".join(_ranks(ranks) for ranks in ordered) + " disagree, with no majority"
    more = int(differs.sum()) - 1
    return f"{names[first]}: {who}" + (f" ({more} more tensor(s) differ)" if more else "")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
