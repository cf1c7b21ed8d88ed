"""Fixtures for the tests across hosts made of network namespaces (bench/netns.py).

Where namespaces cannot be made (not root, no iproute2), every test here is skipped with the reason,
loudly; with REQUIRE_NETNS=1 (CI) it fails instead, so a machine that cannot run them never passes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.netns import Hosts, cannot_create_reason
from tests.e2e.conftest import data_dir  # noqa: F401  (the small CIFAR10 set, made once per session)


def require_netns() -> None:
    """Skip loudly where network namespaces cannot be made; fail instead under REQUIRE_NETNS=1."""
    reason = cannot_create_reason()
    if reason is not None:
        if os.environ.get("REQUIRE_NETNS") == "1":
            pytest.fail(f"REQUIRE_NETNS=1 but network namespaces cannot be created: {reason}")
        pytest.skip(f"SKIPPED LOUDLY: network namespaces cannot be created here ({reason}): run as root with iproute2")


def _made(count: int) -> Iterator[Hosts]:
    require_netns()
    with Hosts(count) as made:
        yield made


@pytest.fixture(scope="module", params=[2, 3], ids=["2 hosts", "3 hosts"])
def hosts(request) -> Iterator[Hosts]:
    yield from _made(request.param)


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[Hosts]:
    yield from _made(2)
