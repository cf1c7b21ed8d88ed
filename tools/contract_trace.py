"""What each rank trained each step on, for the contract to name why a resume differs (``DDP_LAB_TRACE``).

The contract installs this module's observer in its runs (``env``: ``DDP_LAB_OBSERVERS``, and ``DDP_LAB_TRACE``
naming a folder; ``ddp_core/observers.py``), and every rank appends one JSON line per micro-batch to
``<folder>/<run name>/rank<R>.jsonl``: the optimizer step it belongs to, a fingerprint of the batch (its tensors'
sums, plain and position-weighted: another sample or another order changes it) and a hash of the random streams as
the batch is handed to the loop. Comparing a resumed run's lines with the uninterrupted run's tells a sampler that
restarted its epoch (other batches) from a random state the checkpoint did not hold (same batches, other streams);
each rank's last line, the step it stopped after.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ddp_core import observers
from ddp_core.observers import Observer
from ddp_core.training.seed import get_rng_state

VARIABLE = "DDP_LAB_TRACE"


def fingerprint(batch: Any) -> list[float]:
    """Two numbers per tensor in ``batch`` (nested tuples, lists and dicts too): its sum and its sum weighted
    by position, in float64 on the CPU."""
    if isinstance(batch, torch.Tensor):
        flat = batch.detach().reshape(-1).double().cpu()
        return [flat.sum().item(), (flat * torch.arange(1, len(flat) + 1, dtype=torch.float64)).sum().item()]
    if isinstance(batch, dict):
        return [x for key in sorted(batch) for x in fingerprint(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [x for item in batch for x in fingerprint(item)]
    return []


def streams_hash() -> str:
    """A short hash of this process's random states (python, numpy, torch, this rank's GPU)."""
    state = get_rng_state()
    flat = {key: value.numpy().tobytes() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    flat["numpy"] = {k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v for k, v in state["numpy"].items()}
    return hashlib.sha256(pickle.dumps(flat)).hexdigest()[:16]


class BatchTrace(Observer):
    """Appends one line per micro-batch handed to the loop, under ``folder`` once the run is known."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path: Path | None = None

    def run_started(self, run_dir: Path, rank: int) -> None:
        self.path = self.folder / run_dir.name / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def batch(self, step: int, batch: Any) -> None:
        if self.path is None:
            return
        line = {"step": step, "batch": fingerprint(batch), "streams": streams_hash()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")


def env(folder: Path) -> dict[str, str]:
    """What a run needs to trace what each rank trained into ``folder``."""
    return {VARIABLE: str(folder), **observers.env(__name__)}


def observer() -> BatchTrace | None:
    """The worker's trace where ``DDP_LAB_TRACE`` names a folder (``ddp_core.observers`` installs it)."""
    folder = os.environ.get("DDP_LAB_TRACE", "")  # VARIABLE, spelled out: the docs test reads it here
    return BatchTrace(Path(folder)) if folder else None


def last_steps(folder: Path, run_name: str) -> dict[int, int]:
    """The step of the last batch each rank was handed in one run, by rank (a rank that traced nothing is absent)."""
    return {rank: lines[-1]["step"] for rank, lines in read(folder, run_name).items() if lines}


def read(folder: Path, run_name: str) -> dict[int, list[dict[str, Any]]]:
    """Each rank's lines of one run, by rank."""
    traces = {}
    for path in sorted((folder / run_name).glob("rank*.jsonl")):
        traces[int(path.stem.removeprefix("rank"))] = [json.loads(line) for line in path.read_text().splitlines()]
    return traces
