"""A real one-node Slurm for tests/slurm (tests/slurm/cluster.py installs and starts it).

These tests install packages and start daemons, and take about three minutes, so they run only when
asked: `make slurm-check` (pytest -m slurm) or REQUIRE_SLURM=1 (CI, `make test` there). Elsewhere, e.g.
a plain `make test`, they are skipped with that reason. Asked for but not root or without a usable apt:
skipped loudly, or failed with REQUIRE_SLURM=1.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.slurm import cluster

# What each scenario found, for the one line at the end of the session (pytest_terminal_summary).
RESULTS: dict[str, str] = {}
ORDER = ("preempted", "time limit")


def _asked_for(config: pytest.Config) -> bool:
    """-m slurm (or an expression selecting it), as `make slurm-check` runs it."""
    markexpr = config.getoption("markexpr", "") or ""
    return re.search(r"(?<!not )\bslurm\b", markexpr) is not None


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> str:
    """Slurm running on this machine (installed and started if need be); its one-line state."""
    required = os.environ.get("REQUIRE_SLURM") == "1"
    if not required and not _asked_for(request.config):
        pytest.skip("a real Slurm is installed and started for these: set REQUIRE_SLURM=1 or run make slurm-check")
    try:
        return cluster.ensure_running()
    except cluster.Unavailable as why:
        if required:
            pytest.fail(f"REQUIRE_SLURM=1 but Slurm cannot be installed here: {why}")
        pytest.skip(f"SKIPPED LOUDLY: Slurm cannot be installed here: {why}")
    except (cluster.ClusterError, subprocess.TimeoutExpired) as error:
        pytest.fail(f"Slurm did not come up: {error}")


def pytest_terminal_summary(terminalreporter) -> None:
    if RESULTS:
        parts = [RESULTS[name] for name in ORDER if name in RESULTS]
        terminalreporter.write_line("slurm: " + "; ".join(parts))
