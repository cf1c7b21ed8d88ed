"""The stress loops over hosts made of network namespaces run, one run each, and say what they counted.

bench.missing_node and bench.cannot_choose count rare failures over hundreds of runs (docs/benchmarks.md);
here each makes its hosts, runs once, and prints its summary, so that neither rots between the times it is used.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.launch import REPO, clean_env
from tests.hosts.conftest import require_netns

pytestmark = pytest.mark.hosts

CASES = {
    "missing_node": (
        ["--runs", "1", "--hosts", "2", "--rendezvous", "static"],
        "  static: 0 of 1 runs did not end with the one line",
    ),
    "cannot_choose": (["--runs", "1"], "  0 of 1 runs did not stop every node with its one line within 60 s"),
}


@pytest.mark.parametrize("bench", list(CASES))
def test_one_run_of_each_loop_counts_no_failure(bench: str):
    require_netns()
    args, summary = CASES[bench]
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert summary in result.stdout.splitlines(), result.stdout
