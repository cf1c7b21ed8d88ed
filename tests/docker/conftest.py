"""Docker tests: skipped with a loud reason where the tools are missing, failed instead when REQUIRE_DOCKER=1 (CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def require_tool(what: str, found: bool) -> None:
    if found:
        return
    message = f"{what} is not installed: install it (`.ci/run` shows how) to run the Docker tests"
    if os.environ.get("REQUIRE_DOCKER") == "1":
        pytest.fail(f"REQUIRE_DOCKER=1 but {message}")
    pytest.skip(f"SKIPPED LOUDLY: {message}")


@pytest.fixture(scope="session")
def compose_commands() -> list[list[str]]:
    """Every Compose we can find: Debian's v1.29 `docker-compose` and/or Compose v2 (`docker compose`)."""
    commands = []
    if shutil.which("docker-compose"):
        commands.append(["docker-compose"])
    for docker in ("/usr/bin/docker", shutil.which("docker")):
        if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
            commands.append([docker, "compose"])
            break
    require_tool("Docker Compose (docker-compose or the docker compose plugin)", bool(commands))
    return commands
