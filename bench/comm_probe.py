"""``torchrun ... -m bench.comm_probe experiments.NAME FLAGS``: the experiment, and each rank's optimizer state.

bench.comm starts every run through this module instead of ``-m experiments.NAME``: the same entry point
(flags, checks, ``TrainingRun``, metrics.json) with the experiment's ``train`` wrapped. Once ``train`` has
returned, still inside the run and its process group, every rank measures the optimizer it stepped and
global rank 0 writes what all of them measured to ``PROBE_FILE`` in the run directory. Measured there
because only the training processes hold the optimizer; a separate file, because metrics.json is the
lifecycle's own.

What is measured, in bytes of tensor data (each storage counted once):

- ``state``: the tensors in this rank's optimizer state (SGD's momentum, AdamW's moments and step). Under
  --zero that is the state of the ``ZeroRedundancyOptimizer``'s local optimizer: this rank's share. The
  state is allocated at the first step and never grows after it, so its size at the end is its peak.

Nothing else stays: a checkpoint under --zero joins the ranks' shares itself and keeps no gathered copy
(ddp_core.training.comm).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ddp_core.distributed.agreement import rank0_decides
from ddp_core.distributed.collectives import all_gather_object
from ddp_core.experiment import TrainingRun
from ddp_core.process.entry import EntryMain

PROBE_FILE = "comm_probe.json"


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (an optimizer state or a state_dict)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value``, each storage counted once (a view adds nothing)."""
    seen: set[int] = set()
    total = 0
    for tensor in _tensors(value):
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's ``state`` bytes (the module docstring says what it holds)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps its share through .optim
    return {"state": tensor_bytes(dict(local.state))}


def measured(train: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(train)
    def train_and_measure(run: TrainingRun, *rest: Any) -> dict[str, Any]:
        metrics = train(run, *rest)
        if run.loop is not None and not run.loop.stopped:  # every rank ends alike: all of them gather, or none does
            ranks = all_gather_object(optimizer_state_bytes(run.loop.optimizer))
            rank0_decides(
                lambda: (run.dir / PROBE_FILE).write_text(json.dumps({"optimizer_bytes": ranks}, indent=2) + "\n")
            )
        return metrics

    return train_and_measure


def probed(module: str) -> EntryMain[Any, dict[str, Any]]:
    main = importlib.import_module(module).main  # an experiment's: its work is a Training
    return dataclasses.replace(main, work=dataclasses.replace(main.work, train=measured(main.work.train)))


if __name__ == "__main__":
    if len(sys.argv) < 2 or not sys.argv[1].startswith("experiments."):
        sys.exit("usage: python -m bench.comm_probe experiments.NAME [the experiment's flags]")
    probe = probed(sys.argv.pop(1))  # the experiment parses the rest of the command line as its own
    probe.run_and_exit()
