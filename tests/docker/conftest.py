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


def find_compose_commands() -> list[list[str]]:
    """Every Compose we can find: Debian's v1.29 `docker-compose` and/or Compose v2 (`docker compose`)."""
    commands = []
    if shutil.which("docker-compose"):
        commands.append(["docker-compose"])
    for docker in ("/usr/bin/docker", shutil.which("docker")):
        # Runs at collection: a missing binary must mean "no Compose v2", not an error for the whole suite.
        if (
            docker
            and os.access(docker, os.X_OK)
            and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
        ):
            commands.append([docker, "compose"])
            break
    return commands


def require_both_composes(commands: list[list[str]]) -> None:
    """Users run v2, CI has Debian's v1.29: the files must hold for both."""
    versions = {"v1": any(c == ["docker-compose"] for c in commands), "v2": any(c[-1] == "compose" for c in commands)}
    for version, found in versions.items():
        require_tool(f"Docker Compose {version}", found)


@pytest.fixture(scope="session")
def compose_commands() -> list[list[str]]:
    commands = find_compose_commands()
    require_tool("Docker Compose (docker-compose or the docker compose plugin)", bool(commands))
    if os.environ.get("REQUIRE_DOCKER") == "1":
        require_both_composes(commands)
    return commands
