"""Fixtures for the tests across hosts made of network namespaces (tests/hosts/netns.py).

Where namespaces cannot be made (not root, no iproute2), every test here is skipped with the reason,
loudly; with REQUIRE_NETNS=1 (CI) it fails instead, so a machine that cannot run them never passes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.cifar10_data import make_learnable_images, write_cifar10_format
from tests.hosts.netns import Hosts, cannot_create_reason

CIFAR_TRAIN_IMAGES, CIFAR_TEST_IMAGES = 384, 101


@pytest.fixture(scope="module", params=[2, 3], ids=["2 hosts", "3 hosts"])
def hosts(request) -> Iterator[Hosts]:
    reason = cannot_create_reason()
    if reason is not None:
        if os.environ.get("REQUIRE_NETNS") == "1":
            pytest.fail(f"REQUIRE_NETNS=1 but network namespaces cannot be created: {reason}")
        pytest.skip(f"SKIPPED LOUDLY: network namespaces cannot be created here ({reason}): run as root with iproute2")
    with Hosts(request.param) as made:
        yield made


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """A small learnable CIFAR10 in the exact on-disk format (pass --no-verify: the md5 sums differ)."""
    root = tmp_path_factory.mktemp("cifar")
    train, test = make_learnable_images(CIFAR_TRAIN_IMAGES, seed=0), make_learnable_images(CIFAR_TEST_IMAGES, seed=1)
    write_cifar10_format(root, train.images, train.labels, test.images, test.labels)
    return root
