"""The suite's own scheduling: the modules it starts first exist, and come first in the collection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import LONGEST_FIRST

REPO = Path(__file__).resolve().parents[2]


def test_every_module_started_first_exists_and_is_collected_first():
    assert [module for module in LONGEST_FIRST if not (REPO / module).is_file()] == []
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:xdist",
            "tests/unit/test_stress.py",
            *LONGEST_FIRST[-2:],
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    modules = list(dict.fromkeys(line.split("::")[0] for line in collected.splitlines() if "::" in line))
    assert modules == [*LONGEST_FIRST[-2:], "tests/unit/test_stress.py"], collected[-2000:]
