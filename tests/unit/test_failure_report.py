"""The launcher's hang report names the flight-recorder files where the workers wrote them: the run directory
by default, or the prefix a user's TORCH_FR_DUMP_TEMP_FILE gives (the workers' value is the launcher's)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ddp_core.exit_codes import HUNG_EXIT_CODE
from ddp_core.process.failure_report import RankFailure, report
from ddp_core.process.heartbeat import Heartbeat

HUNG = RankFailure(0, "node0", 1, "CollectiveTimeoutError: rank(s) 1 did not arrive")


def hang_report(run_dir: Path) -> str:
    lines, code = report([HUNG], {0: Heartbeat(0, 7, "node0", run_dir)}, run_dir / "failure_node0.txt")
    assert code == HUNG_EXIT_CODE and lines[0] == "error: rank(s) 1 did not arrive"
    return lines[1]


@pytest.mark.parametrize(
    ("prefix", "files", "shown"),
    [
        (None, ["run/flight_recorder_rank_0", "run/flight_recorder_rank_2"], "flight_recorder {run}); torch's"),
        (
            "dumps/trace_",
            ["dumps/trace_0", "run/flight_recorder_rank_0"],
            "flight_recorder {dumps} --prefix trace_); torch's",
        ),
        (None, [], "no flight-recorder file was written; torch's"),
        ("dumps/trace_", ["run/flight_recorder_rank_0"], "no flight-recorder file was written"),
    ],
)
def test_the_hang_report_names_the_dumps_where_they_are(tmp_path, monkeypatch, prefix, files, shown):
    (tmp_path / "run").mkdir()
    (tmp_path / "dumps").mkdir()
    for name in files:
        (tmp_path / name).write_text("{}")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    if prefix:
        monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / prefix))
    line = hang_report(tmp_path / "run")
    assert shown.format(run=tmp_path / "run", dumps=tmp_path / "dumps") in line, line
    for name in files:  # each file of this job's prefix is named, no other
        ours = name.startswith(prefix.split("/")[0]) if prefix else True
        assert (f"{tmp_path / name}," in line or f"{tmp_path / name} (" in line) == ours, line


def test_the_hang_report_has_each_rank_s_line_then_names_the_stack_files(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    (tmp_path / "stacks_rank_0.txt").write_text("rank 0: train.py:9 train, in all_reduce #4 (sizes [[1]])\n\n...")
    (tmp_path / "stacks_rank_1.txt").write_text("rank 1: train.py:3 read_shard (no collective)\n\n...")
    beats = {rank: Heartbeat(rank, 7, "node0", tmp_path) for rank in (1, 0)}
    lines, code = report([HUNG], beats, tmp_path / "failure_node0.txt")
    assert code == HUNG_EXIT_CODE and lines[1:3] == [
        "rank 0: train.py:9 train, in all_reduce #4 (sizes [[1]])",
        "rank 1: train.py:3 read_shard (no collective)",
    ]
    assert f"each rank's stacks: {tmp_path / 'stacks_rank_N.txt'}; torch's" in lines[3] and len(lines) == 4


@pytest.mark.parametrize("dumped", [True, False])
def test_a_rank_aborted_after_its_flight_recorder_dump_is_a_hang(tmp_path, monkeypatch, dumped):
    """NCCL's watchdog dumps the flight recorder, then aborts the rank: a hang, not a crash in native code."""
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    if dumped:
        (tmp_path / "flight_recorder_rank_2").write_bytes(b"")
    (tmp_path / "stacks_rank_2.txt").write_text("rank 2: train.py:9 train (aborted)\n")
    aborted = RankFailure(2, "node0", -signal.SIGABRT)
    lines, code = report([aborted], {2: Heartbeat(2, 7, "node0", tmp_path)}, tmp_path / "failure_node0.txt")
    if dumped:
        assert code == HUNG_EXIT_CODE and lines[0].startswith("error: rank 2 aborted after a flight-recorder dump")
        assert lines[1] == "rank 2: train.py:9 train (aborted)"
    else:
        assert code == 128 + signal.SIGABRT and "crash in native code" in lines[0]
