"""The launcher's hang report names the flight-recorder files where the workers wrote them: the run directory
by default, or the prefix a user's TORCH_FR_DUMP_TEMP_FILE gives (the workers' value is the launcher's)."""

from __future__ import annotations

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
