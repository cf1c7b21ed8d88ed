"""python -m ddp_core.contract on CIFAR10 and on charlm: the run object on two more domains keeps it.

Apart from test_contract.py so that two pytest workers can share the four contract runs (each about a
minute)."""

from __future__ import annotations

from pathlib import Path

from ddp_core.contract import PROPERTIES
from tests.e2e.test_contract import contract, verdicts


def test_cifar10_keeps_every_property(data_dir: Path):
    result = contract("experiments.cifar10", extra=("--data-dir", str(data_dir), "--no-verify"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    expected = {name: "PASS" for name in PROPERTIES} | {"world-size": "SKIP"}  # augmentation differs per rank
    assert verdicts(result.stdout) == expected, result.stdout


def test_charlm_keeps_every_property():
    """The run object on a second domain: a transformer, AdamW, clipping, per-rank windows from the RNG."""
    result = contract("experiments.charlm")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    expected = {name: "PASS" for name in PROPERTIES} | {"world-size": "SKIP"}  # each rank draws its own windows
    assert verdicts(result.stdout) == expected, result.stdout
