"""bench.ddp_overhead: every variant measured for real in 2 processes, bad options refused in one line.

Timings are not asserted (benchmarks do not run as tests); only that the table is complete and
its ratios are the ratios of its own times.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from bench import ddp_overhead
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from tests import prefork


def test_a_real_two_process_run_has_every_variant_with_positive_times():
    completed = subprocess.run(
        [
            prefork.python(),  # the launcher and its two spawned processes fork from the suite's server
            "-m",
            "bench.ddp_overhead",
            "--models",
            "small",
            "--batch-size",
            "4",
            "--rounds",
            "1",
            "--bucket-mb",
            "25,1,100",
            "--grad-accum",
            "2",
            "--backend",
            "gloo",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(completed.stdout[completed.stdout.index("{") :])  # rank 0 alone prints it
    assert (result["world_size"], result["backend"], result["device"]) == (2, "gloo", "cpu")
    variants = [(row["model"], row["bucket_cap_mb"], row["grad_accum"]) for row in result["rows"]]
    assert variants == [("small", 25.0, 1), ("small", 1.0, 1), ("small", 100.0, 1), ("small", 25.0, 2)]
    assert [row["variant"] for row in result["rows"]] == [
        "bucket 25 MB (default)",
        "bucket 1 MB",
        "bucket 100 MB",
        "bucket 25 MB (default), grad accum 2",
    ]
    for row in result["rows"]:
        assert row["ddp_ms"] > 0 and row["no_comm_ms"] > 0
        assert row["ratio"] == pytest.approx(row["ddp_ms"] / row["no_comm_ms"])
        assert row["buckets"] >= 1  # the small model's 0.9 MB of gradients fit one bucket of any of these sizes


def test_the_markdown_table_has_a_row_per_variant():
    row = {
        "model": "small",
        "variant": "bucket 1 MB",
        "bucket_cap_mb": 1.0,
        "grad_accum": 1,
        "buckets": 1,
        "gradients_mb": 0.92,
        "ddp_ms": 30.0,
        "no_comm_ms": 20.0,
        "ratio": 1.5,
    }
    result = {
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "torch": "x",
        "batch_size": 32,
        "rounds": 3,
        "steps": 1,
        "threads": 1,
        "sync_bn": True,
        "rows": [row, {**row, "buckets": None}],
    }
    lines = ddp_overhead.markdown(result).splitlines()
    assert lines[2].startswith("| model | variant |") and lines[3].startswith("|---")
    assert lines[4] == "| small (0.9 MB of gradients) | bucket 1 MB | 1 | 30.0 | 20.0 | 10.0 | 1.50× |"
    assert lines[5].split(" | ")[2] == "?"


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--rounds", "0"], "--rounds=0"),
        (["--batch-size", "-3"], "--batch-size=-3"),
        (["--grad-accum", "1"], "--grad-accum=1"),
        (["--models", "resnet50"], "--models='resnet50'"),
        (["--models", "small,small"], "--models='small,small'"),
        (["--bucket-mb", "0"], "--bucket-mb='0'"),
        (["--bucket-mb", "25,abc"], "--bucket-mb='25,abc'"),
        (["--bucket-mb", "nan"], "--bucket-mb='nan'"),
        (["--nproc", "0"], "--nproc=0"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ddp_overhead.main(argv)  # refused while parsing: no process is started
    assert exit_info.value.code == CONFIG_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and names in err, err


def test_make_bench_runs_it():
    source = open(os.path.join(os.path.dirname(ddp_overhead.__file__), "__main__.py")).read()
    run = re.search(r"for module in \(([^)]*)\):\n\s+.*\n\s+module\.main\(\[\]\)", source)
    assert run is not None and "ddp_overhead" in run[1].split(", ")
