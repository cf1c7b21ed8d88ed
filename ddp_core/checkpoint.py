"""Checkpoints: written atomically by global rank 0, read back with ``weights_only=True``.

A checkpoint holds the model's state without DDP's ``module.`` prefix (so it loads into a plain model),
the optimizer, step and epoch, the world size, and every rank's RNG states: what a bitwise-exact
resume needs (design fact 3).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from torch import nn

from ddp_core.collectives import broadcast_object, gather_object
from ddp_core.dist import is_main, rank, unwrap, world_size
from ddp_core.errors import ConfigError
from ddp_core.seed import get_rng_state, set_rng_state

FORMAT = "ddp-lab/1"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP, torch.compile


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says why."""


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop the wrapper prefixes DDP and torch.compile add to every key (legacy checkpoints have them)."""
    clean = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        clean[key] = value
    return clean


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write to a temp file, fsync, then ``os.replace``: a kill mid-write leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f".{path.name}.tmp-*"):  # from a save that was killed
        leftover.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    epoch: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Collective: every rank calls it (each contributes its RNG state); only global rank 0 writes."""
    rng_states = gather_object(get_rng_state())
    if not is_main():
        return
    state = {
        "format": FORMAT,
        "model": unwrap(model).state_dict(),  # unwrapped: no module./_orig_mod. prefixes
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": step,
        "epoch": epoch,
        "world_size": world_size(),
        "rng": rng_states,
        "extra": extra or {},
    }
    atomic_write(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with ``weights_only=True``: tensors and plain types only, so a crafted file cannot run code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if path.stat().st_size < len(b"PK\x03\x04"):  # less than a zip header: read as a (broken) raw pickle
            raise CheckpointError(f"{path} is truncated or corrupt (only {path.stat().st_size} bytes): resume from an earlier checkpoint") from error
        raise CheckpointError(
            f"{path} was refused by the weights-only loader: it holds more than tensors and plain types; "
            "only load files you trust, and never with weights_only=False"
        ) from error
    except (EOFError, RuntimeError, OSError) as error:
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(error)}): resume from an earlier checkpoint") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_model_state(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Load weights saved from a plain, DDP-wrapped or compiled model into any of them."""
    target = unwrap(model)
    if set(state_dict) != set(target.state_dict()):  # a legacy file saved from the wrapper (a child named
        state_dict = strip_prefixes(state_dict)      # `module` must keep its name, so strip only on mismatch)
    target.load_state_dict(state_dict)


def load_on_rank0_and_broadcast(path: str | Path) -> dict[str, Any]:
    """Rank 0 reads the file (other nodes need not see it) and sends its contents to every rank."""
    result: tuple[str, Any] = ("ok", None)
    if is_main():
        try:
            result = ("ok", load_checkpoint(path))
        except CheckpointError as error:
            result = ("error", str(error))
    status, payload = broadcast_object(result)
    if status == "error":
        raise CheckpointError(payload)
    return payload


def restore(checkpoint: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """Load model, optimizer and this rank's RNG states; returns (step, epoch).

    An exact resume needs the world size the checkpoint was written with: data shards and RNG streams
    depend on it.
    """
    if checkpoint.get("format") != FORMAT:
        raise CheckpointError(f"not a ddp-lab checkpoint (format {checkpoint.get('format')!r}, expected {FORMAT!r})")
    if checkpoint["world_size"] != world_size():
        raise ConfigError(
            f"the checkpoint was written by {checkpoint['world_size']} processes and this run has {world_size()}: "
            f"resume with --nproc-per-node/--nnodes giving WORLD_SIZE={checkpoint['world_size']}"
        )
    load_model_state(model, checkpoint["model"])
    if optimizer is not None and checkpoint["optimizer"] is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    set_rng_state(checkpoint["rng"][rank()])
    return checkpoint["step"], checkpoint["epoch"]
