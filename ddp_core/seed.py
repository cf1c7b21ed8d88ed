"""Seeding, determinism, and RNG state that survives a weights_only checkpoint.

The rule: the model is initialised from ``seed`` alone, so every rank builds the same weights (DDP
would broadcast rank 0's anyway, but buffers and anything built outside DDP must agree too). Everything
random after that (augmentation, dropout, DataLoader workers) is seeded from ``(seed, global rank)``,
never the local rank, which repeats on every node.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every device) with the same value."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rank_seed(seed: int, rank: int) -> int:
    """A per-rank seed; unlike ``seed + rank``, (seed=1, rank=0) and (seed=0, rank=1) do not collide."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


def seed_rank_streams(seed: int, rank: int) -> None:
    """Call after building the model: from here on random draws differ per global rank."""
    seed_everything(rank_seed(seed, rank))


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """A DataLoader's own generator, seeded per global rank.

    The DataLoader draws its workers' base seed from it, so workers differ across ranks, and creating an
    iterator no longer draws from the global RNG (which would shift every later random draw; design fact 3).
    """
    return torch.Generator().manual_seed(rank_seed(seed, rank))


def worker_init_fn(worker_id: int) -> None:
    """DataLoader workers: torch already gives each worker base_seed + worker_id; derive numpy and python from it."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


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
        state["cuda"] = torch.cuda.get_rng_state_all()
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
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
