"""One spawned group per world size runs every check that needs a working group (workers.world_checks)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import SpawnedWorlds
from tests.distributed.workers import world_checks


@pytest.fixture(scope="session")
def world_runs(tmp_path_factory: pytest.TempPathFactory) -> SpawnedWorlds:
    return SpawnedWorlds(world_checks, tmp_path_factory, lambda folder: (str(folder / "output"),))


@pytest.fixture(params=[2, 3], ids=lambda w: f"world{w}")
def world_size(request: pytest.FixtureRequest) -> int:
    return request.param
