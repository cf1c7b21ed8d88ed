"""experiments.commbench (tools/commbench.py) launched by torchrun at 2, 3 and 4 processes (gloo, small sizes),
and its correctness check caught failing: in-process in a world of one, and at 2 processes with one rank's
result corrupted.

Run as a module (``torchrun ... -m tests.e2e.test_commbench``), this file is commbench with one collective
corrupted on one rank (COMMBENCH_CORRUPT=op:rank): the negative control of the 2-process check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core.layout import CODE, GIT_DIFF
from tests.e2e.launch import LAUNCH_VARIABLES, run, torchrun, torchrun_command

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "sendrecv"]
SIZES = [1024, 4096, 16384]  # --min-bytes 1024 --max-bytes 20000 --factor 4: 20000 is not hit, 16384 is the last
SMALL = ("--min-bytes", "1024", "--max-bytes", "20000", "--factor", "4", "--warmup", "1", "--iters", "3")
# nccl-tests's factors written out (not computed with the formula under test)
FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 1 / 2, "reduce_scatter": 1 / 2, "all_to_all": 1 / 2},
    3: {"all_reduce": 4 / 3, "all_gather": 2 / 3, "reduce_scatter": 2 / 3, "all_to_all": 2 / 3},
    4: {"all_reduce": 3 / 2, "all_gather": 3 / 4, "reduce_scatter": 3 / 4, "all_to_all": 3 / 4},
}
CHUNKED = {"all_gather", "reduce_scatter", "all_to_all"}


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}proc")
def bench_run(request, tmp_path_factory):
    nproc = request.param
    tmp = tmp_path_factory.mktemp(f"commbench{nproc}")
    run_dir, json_path = tmp / "run", tmp / "out" / "results.json"
    result = torchrun(
        nproc, "experiments.commbench", "--run-dir", str(run_dir), "--json", str(json_path), *SMALL, timeout=120
    )
    return nproc, run_dir, json.loads(json_path.read_text()), result


def test_every_op_and_size_is_measured_and_correct(bench_run):
    nproc, _, results, _ = bench_run
    assert (results["world_size"], results["backend"], results["device"], results["dtype"]) == (
        nproc,
        "gloo",
        "cpu",
        "float32",
    )
    assert [(row["op"], row["requested_bytes"]) for row in results["rows"]] == [
        (op, size) for op in OPS for size in SIZES
    ]
    assert [row["check"] for row in results["rows"]] == ["ok"] * len(OPS) * len(SIZES)
    assert results["all_ok"] is True and results["wrong"] == 0
    for row in results["rows"]:
        assert row["bytes"] == row["count"] * 4 and row["bytes"] <= row["requested_bytes"]
        if row["op"] in CHUNKED:
            assert row["count"] % nproc == 0 and row["requested_bytes"] - row["bytes"] < 4 * nproc
        else:
            assert row["bytes"] == row["requested_bytes"]


def test_busbw_is_algbw_times_the_factor_for_the_world_size(bench_run):
    nproc, _, results, _ = bench_run
    for row in results["rows"]:
        factor = FACTORS[nproc].get(row["op"], 1.0)
        assert row["bus_factor"] == pytest.approx(factor, rel=1e-12), row
        assert len(row["time_us_per_rank"]) == nproc and row["time_us"] == max(row["time_us_per_rank"]) > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor, rel=1e-12)
    assert results["peak_busbw_GBps"] == {
        op: max(r["busbw_GBps"] for r in results["rows"] if r["op"] == op) for op in OPS
    }


def test_rank_0_alone_wrote_the_run_directory_and_printed_the_table(bench_run):
    nproc, run_dir, results, result = bench_run
    files = _files(run_dir)
    events = [name for name in files if name.startswith("events.out.tfevents.")]
    assert len(events) == 1, files  # one writer, not one per rank
    code = [CODE, f"{CODE}/commbench.py", f"{CODE}/{GIT_DIFF}"]  # the code that ran, kept with the run
    assert files == sorted(["checkpoints", "manifest.json", "metrics.json", *code, *events]), files
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["experiment"] == "commbench" and manifest["world"]["world_size"] == nproc
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics.pop("wall_time_s") > 0 and metrics == results

    lines = result.stdout.splitlines()
    assert sum("algbw (GB/s)" in line for line in lines) == 1, result.stdout  # the header, once
    table = [line.split() for line in lines if line.split()[:1] and line.split()[0] in OPS]
    assert [(cells[0], int(cells[1])) for cells in table] == [(r["op"], r["bytes"]) for r in results["rows"]]
    assert all(cells[-1] == "ok" for cells in table)

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    for op in OPS:
        points = accumulator.Scalars(f"commbench/{op}/busbw_GBps")
        assert [p.step for p in points] == [10, 12, 14]  # log2 of the requested sizes
        rows = [r for r in results["rows"] if r["op"] == op]
        assert [p.value for p in points] == pytest.approx([r["busbw_GBps"] for r in rows], rel=1e-6)


# ------------------------------------------------------------------------------------- the check, failing


def _corrupt(op: str, on_rank: int | None = None) -> None:
    """Make ``op`` add 1 to the first element of its result (on ``on_rank``, or everywhere)."""
    from tools import commbench

    genuine = commbench.COLLECTIVES[op]

    def corrupted(buffers, rank, world):
        genuine(buffers, rank, world)
        if on_rank is None or rank == on_rank:
            buffers.recv[0] += 1

    commbench.COLLECTIVES[op] = corrupted


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest's captured stderr
def test_a_wrong_result_is_reported_and_exits_1_in_process(tmp_path, monkeypatch, capsys):
    from tools import commbench

    for name in LAUNCH_VARIABLES:  # a world of one in this process
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(commbench.COLLECTIVES, "all_reduce", commbench.COLLECTIVES["all_reduce"])  # restored afterwards
    _corrupt("all_reduce")
    json_path = tmp_path / "results.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        commbench.main(
            ["--run-dir", str(tmp_path / "run"), "--json", str(json_path), "--ops", "all_reduce,broadcast", *SMALL]
        )
    assert info.value.code == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines == [
        "error: 3 result(s) WRONG (all_reduce at 1024 bytes, all_reduce at 4096 bytes, all_reduce at 16384 bytes) "
        "on 1 process(es), gloo: the table above names every row"
    ], captured.err
    results = json.loads(json_path.read_text())
    assert [(r["op"], r["check"]) for r in results["rows"]] == [("all_reduce", "WRONG")] * 3 + [("broadcast", "ok")] * 3
    assert results["all_ok"] is False and results["wrong"] == 3
    assert [line.split()[-1] for line in captured.out.splitlines() if line.split()[:1] == ["all_reduce"]] == [
        "WRONG"
    ] * 3
    assert not (tmp_path / "run" / "metrics.json").exists()  # metrics.json: only for a run that ended well
    assert not torch.distributed.is_initialized()


def test_a_wrong_result_on_one_rank_fails_every_rank(tmp_path):
    """At 2 processes rank 1 alone gets a wrong all_gather: the row is WRONG for all, every rank exits 1, one line."""
    json_path = tmp_path / "results.json"
    result = run(
        torchrun_command(
            2,
            "tests.e2e.test_commbench",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            str(json_path),
            "--ops",
            "all_gather,sendrecv",
            *SMALL,
        ),
        timeout=120,
        COMMBENCH_CORRUPT="all_gather:1",
    )
    assert result.returncode == 1, result.stderr[-3000:]
    results = json.loads(json_path.read_text())
    assert [(r["op"], r["check"]) for r in results["rows"]] == [("all_gather", "WRONG")] * 3 + [("sendrecv", "ok")] * 3
    assert result.stderr.count("result(s) WRONG") == 1, result.stderr[-3000:]  # printed by rank 0 only
    assert "local_rank: 0" in result.stderr and "local_rank: 1" in result.stderr  # torchrun: both workers failed


if __name__ == "__main__":  # commbench with COMMBENCH_CORRUPT=op:rank, for the test above
    from ddp_core.process.exit import run_and_exit
    from tools import commbench

    op, rank = os.environ["COMMBENCH_CORRUPT"].split(":")
    _corrupt(op, int(rank))
    run_and_exit(commbench.main)
