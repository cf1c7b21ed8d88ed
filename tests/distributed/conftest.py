"""One spawned group per world size runs every check that needs a working group (workers.world_checks)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_distributed
from tests.distributed.workers import world_checks


class _WorldRuns(dict):
    """``runs[world_size]``: every rank's ``world_checks`` result; each world size is spawned once, on first use."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self._tmp = tmp_path_factory
        self._failed: dict[int, BaseException] = {}

    def __missing__(self, world_size: int) -> list[dict[str, Any]]:
        if world_size in self._failed:  # spawn a failing world once, not once per test
            raise RuntimeError(f"the {world_size}-rank run failed (see the first test that used it)") from self._failed[world_size]
        base = self._tmp.mktemp(f"world{world_size}")
        try:
            self[world_size] = run_distributed(world_checks, world_size, str(base / "output"), tmp_dir=base / "results")
        except BaseException as error:
            self._failed[world_size] = error
            raise
        return self[world_size]


@pytest.fixture(scope="session")
def world_runs(tmp_path_factory: pytest.TempPathFactory) -> _WorldRuns:
    return _WorldRuns(tmp_path_factory)


@pytest.fixture(params=[2, 3], ids=lambda w: f"world{w}")
def world_size(request: pytest.FixtureRequest) -> int:
    return request.param
