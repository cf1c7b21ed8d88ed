"""bench.comm end to end on a tiny charlm: real 2-process runs through ddp_core.torchrun and bench.comm_probe,
read back into one table (its runs fork from tests.prefork's server: bench.comm starts them with its own
sys.executable, the shim). What it measures is asserted where it cannot be noise: bytes and optimizer state.
Timings are not asserted."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests import prefork
from tests.e2e.launch import REPO, clean_env


def test_a_tiny_charlm_comparison_runs_end_to_end_and_counts_bytes_and_state(tmp_path):
    completed = subprocess.run(
        [
            *(prefork.python(), "-m", "bench.comm", "--experiments", "charlm", "--variants", "none,powersgd,zero"),
            *("--seeds", "1", "--charlm-steps", "6", "--keep", str(tmp_path), "--json"),
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(completed.stdout)["rows"]}
    assert list(rows) == ["none", "powersgd", "zero"]
    none, powersgd, zero = rows["none"], rows["powersgd"], rows["zero"]

    # ZeRO: each rank holds its share of AdamW's moments, which add up to what every rank holds without it
    assert max(zero["state_bytes"]) < 0.6 * max(none["state_bytes"])
    assert sum(zero["state_bytes"]) == none["state_bytes"][0] == none["state_bytes"][1]

    # counted where the hook sends them: PowerSGD's 4 compressed steps of 6 send far less than plain fp32
    assert none["comm_bytes"] > 0 and powersgd["comm_bytes"] < 0.5 * none["comm_bytes"]
    assert zero["comm_bytes"] == none["comm_bytes"]  # ZeRO-1 changes the optimizer, not DDP's all-reduce
    assert zero["metric_mean"] == pytest.approx(none["metric_mean"], abs=1e-4)  # sharding changes no update
    assert (tmp_path / "charlm-zero-round0" / "metrics.json").is_file()  # --keep kept the runs
