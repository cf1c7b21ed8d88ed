"""Seeding, determinism, and RNG state that survives a weights_only checkpoint. The model is built from ``seed``
alone, the same on every rank; every later draw from ``(seed, global rank)``. A seed is 0..2**64-1, refused
outside, never wrapped (docs/decisions.md, "Seeds, samplers, evaluation"; docs/design.md, "Seed ranges")."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

from ddp_core.config import SEED_MAX, SEED_MIN, SEED_NOTE, SEED_RANGE
from ddp_core.errors import ConfigError
from ddp_core.training.host_memory import keep_freed_memory

log = logging.getLogger(__name__)


def fit_seed(seed: int, bits: int) -> int:
    """``seed`` itself when it fits in ``bits`` bits, else a hash of it that does (a modulo would give ``seed`` and
    ``seed + 2**bits`` the same stream)."""
    if 0 <= seed < 2**bits:
        return seed
    return int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint64)[0] >> (64 - bits))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every device) from ``seed`` (0..2**64-1; a ConfigError outside, never wrapped)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise ConfigError(f"seed={seed!r} is out of range: it must be an integer in {SEED_RANGE} ({SEED_NOTE})")
    random.seed(seed)
    np.random.seed(fit_seed(seed, 32))  # the legacy global RNG takes 32 bits
    torch.manual_seed(seed)  # also seeds every CUDA device


def rank_seed(seed: int, rank: int, *more: int) -> int:
    """A per-rank seed; unlike ``seed + rank``, (seed=1, rank=0) and (seed=0, rank=1) do not collide."""
    return int(np.random.SeedSequence([seed, rank, *more]).generate_state(1, dtype=np.uint64)[0] >> 1)


def seed_rank_streams(seed: int, rank: int, step: int = 0) -> None:
    """Call after building the model: from here on random draws differ per global rank. ``step``: streams for
    a run continued from that step at another world size, which must not replay the draws of its start."""
    seed_everything(rank_seed(seed, rank, step) if step else rank_seed(seed, rank))


class RankStreams:
    """This rank's random streams as a per-rank part of the checkpoint; ``start`` seeds them afresh."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def start(self, step: int = 0) -> None:
        seed_rank_streams(self.seed, self.rank, step)

    def state_dict(self) -> dict[str, Any]:
        return get_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """A DataLoader's own generator, seeded per global rank: workers differ across ranks, and an iterator draws
    nothing from the global RNG (docs/design.md, "DataLoader draws")."""
    return torch.Generator().manual_seed(rank_seed(seed, rank))


def worker_init_fn(worker_id: int) -> None:
    """DataLoader workers: torch already gives each worker base_seed + worker_id; derive numpy and python from it."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def speed_switches(device: torch.device, deterministic: bool) -> None:
    """Host memory a step frees kept for the next (``host_memory``); cuDNN autotuning on CUDA, whose choice can differ
    between runs: not with --deterministic."""
    log.debug("host memory: %s", keep_freed_memory())
    if device.type == "cuda" and not deterministic:
        torch.backends.cudnn.benchmark = True


def enable_determinism() -> None:
    """Deterministic algorithms everywhere; on GPU also the cuDNN and cuBLAS settings they need."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def get_rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain types, so ``torch.load(weights_only=True)`` accepts them."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's own GPU only: every visible device's state (get_rng_state_all) ties the checkpoint to
        # this node's GPU count, and restoring it by index on another layout crashes or gives ranks one stream.
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # this rank's own GPU's stream, on whichever GPU it has now
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
