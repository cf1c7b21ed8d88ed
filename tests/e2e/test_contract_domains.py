"""python -m tools.contract on CIFAR10 and on charlm: the run object on two more domains keeps it.

Apart from test_contract.py so that two pytest workers can share the four contract runs (each about a
minute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.cifar10_data import make_learnable_images, write_cifar10_format
from tests.e2e.test_contract import contract, verdicts
from tools.contract import PROPERTIES


@pytest.fixture(scope="module")
def small_data_dir(tmp_path_factory) -> Path:
    """A smaller stand-in than the suite's (its brief runs are 2 epochs): 288 training images, 3 steps an epoch at
    3 processes of 32; 97 test images, divisible by neither 2 nor 3."""
    root = tmp_path_factory.mktemp("cifar-small")
    train, test = make_learnable_images(288, seed=0), make_learnable_images(97, seed=1)
    write_cifar10_format(root, train.images, train.labels, test.images, test.labels)
    return root


def test_cifar10_keeps_every_property(small_data_dir: Path):
    result = contract("experiments.cifar10", extra=("--data-dir", str(small_data_dir), "--no-verify"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    expected = {name: "PASS" for name in PROPERTIES} | {"world-size": "SKIP"}  # augmentation differs per rank
    assert verdicts(result.stdout) == expected, result.stdout


def test_charlm_keeps_every_property():
    """The run object on a second domain: a transformer, AdamW, clipping, per-rank windows from the RNG."""
    result = contract("experiments.charlm")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    expected = {name: "PASS" for name in PROPERTIES} | {"world-size": "SKIP"}  # each rank draws its own windows
    assert verdicts(result.stdout) == expected, result.stdout
