"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.cifar10_data import make_learnable_images, write_cifar10_format

CIFAR_TRAIN_IMAGES, CIFAR_TEST_IMAGES = 640, 301  # 301: divisible by neither 2 nor 3


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A small learnable CIFAR10 in the exact on-disk format (pass --no-verify: the md5 sums differ)."""
    root = tmp_path_factory.mktemp("cifar")
    train, test = make_learnable_images(CIFAR_TRAIN_IMAGES, seed=0), make_learnable_images(CIFAR_TEST_IMAGES, seed=1)
    write_cifar10_format(root, train.images, train.labels, test.images, test.labels)
    return root
