"""Collective helpers that work on gloo and nccl, and with no process group at all (a world of one)."""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Sequence, TextIO

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def comm_device() -> torch.device:
    """Where tensors must live to take part in a collective of the default group."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_tensors(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """All-gather same-shaped, same-dtype tensors in ONE collective (32 separate calls cost 13-22x more on gloo:
    docs/benchmarks.md); ``result[r][i]`` is rank r's ``tensors[i]``."""
    if not tensors:
        return [[] for _ in range(_world()[1])]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"all_gather_tensors needs one dtype, got {sorted(map(str, dtypes))}: cast the tensors first")
    rank, world = _world()
    if len({t.shape for t in tensors}) == 1:
        # The common case, one shape: stack, and one unbind per rank (two C++ calls) instead of a view
        # per tensor; at small sizes those views cost a fifth of the collective itself.
        with torch.no_grad():
            stacked = torch.stack(tensors)
        if world == 1:
            return [list(stacked.unbind(0))]
        gathered = stacked.new_empty((world, *stacked.shape))
        dist.all_gather(list(gathered.unbind(0)), stacked)
        return [list(per_rank.unbind(0)) for per_rank in gathered.unbind(0)]
    # torch's C++ flatten/unflatten (what DDP uses for its buckets): one call each instead of a Python
    # loop of reshape/split/view, which costs more than the collective itself at small sizes.
    with torch.no_grad():
        flat = _flatten_dense_tensors(tensors)
    if world == 1:
        per_rank = [flat]
    else:
        per_rank = list(flat.new_empty(world * flat.numel()).chunk(world))  # views of one buffer
        dist.all_gather(per_rank, flat)
    return [list(_unflatten_dense_tensors(flat_r, tensors)) for flat_r in per_rank]


def all_gather_varsize(tensor: torch.Tensor) -> list[torch.Tensor]:
    """All-gather tensors whose first dimension differs per rank (other dimensions must match)."""
    rank, world = _world()
    if world == 1:
        return [tensor]
    sizes = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device))
    lengths = [int(s.item()) for s in sizes]
    padded = tensor.new_zeros((max(lengths), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g[:n] for g, n in zip(gathered, lengths)]


def gather_tensors(tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
    """Gather equal-shaped tensors to rank ``dst`` (gloo and nccl); other ranks get None."""
    rank, world = _world()
    if world == 1:
        return [tensor]
    gather_list = [torch.empty_like(tensor) for _ in range(world)] if rank == dst else None
    dist.gather(tensor, gather_list=gather_list, dst=dst)
    return gather_list


class _FromDevice(NamedTuple):
    """A sender's GPU tensor, sent as a CPU copy, received on the receiver's device."""

    tensor: torch.Tensor
    requires_grad: bool


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor and _FromDevice inside dicts, lists and tuples; a container in
    which nothing changed is returned as the same object (a state dict keeps its ``_metadata``)."""
    if isinstance(obj, (torch.Tensor, _FromDevice)):
        return fn(obj)
    if isinstance(obj, dict):
        values = [_map_tensors(value, fn) for value in obj.values()]
        if all(new is old for new, old in zip(values, obj.values())):
            return obj
        try:
            copied = type(obj)(zip(obj.keys(), values))
        except TypeError:  # a dict subclass not built from items (defaultdict): a plain dict
            return dict(zip(obj.keys(), values))
        if hasattr(obj, "__dict__"):
            copied.__dict__.update(vars(obj))  # e.g. an OrderedDict state dict's _metadata
        return copied
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(item, fn) for item in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def for_sending(obj: Any) -> Any:
    """Every GPU tensor as a CPU copy marked for the receiver's device: pickle records the device, so rank 1's
    cuda:1 tensor would land on every receiver's cuda:1."""

    def mark(t: Any) -> Any:
        on_cpu = not isinstance(t, torch.Tensor) or t.device.type == "cpu"
        return t if on_cpu else _FromDevice(_host_copy(t), t.requires_grad)

    return _map_tensors(obj, mark)


def as_received(obj: Any, device: torch.device) -> Any:
    """The inverse of ``for_sending``: marked tensors move to ``device``."""

    def land(t: Any) -> Any:
        if not isinstance(t, _FromDevice):
            return t
        return t.tensor.to(device).requires_grad_(t.requires_grad)

    return _map_tensors(obj, land)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order, on every rank; GPU tensors arrive on this rank's GPU."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, for_sending(obj))
    return [as_received(item, comm_device()) for item in out]


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's picklable object, in rank order, on rank ``dst``; None elsewhere."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if rank == dst else None
    dist.gather_object(for_sending(obj), out, dst=dst)
    return None if out is None else [as_received(item, comm_device()) for item in out]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank; its GPU tensors arrive on each rank's own GPU."""
    rank, world = _world()
    if world == 1:
        return obj
    box = [for_sending(obj) if rank == src else None]
    dist.broadcast_object_list(box, src=src, device=comm_device())
    return obj if rank == src else as_received(box[0], comm_device())


_NO_BODY = object()


def print_in_rank_order(title: str, obj: Any = _NO_BODY, file: TextIO | None = None) -> None:
    """Collective: rank 0 prints every rank's block in rank order (separate processes' output interleaves,
    barriers or not)."""
    text = f"Rank {_world()[0]}: {title}" + ("" if obj is _NO_BODY else f"\n{obj}")
    blocks = gather_object(text)
    if blocks is not None:
        print("\n\n".join(blocks) + "\n", file=file or sys.stdout, flush=True)
