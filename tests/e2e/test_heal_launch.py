"""``--heal``, the launcher's side, at 3 processes with a stand-in worker (tests/e2e/heal_probe.py, no torchft in
it): a killed worker alone is replaced, the others keep their processes; with the budget spent the job ends as a
killed worker's does today, one report and exit 137."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ddp_core.process import timeline
from tests.e2e.launch import REPO, clean_env, torchrun_command


def launch(folder: Path, kills: int):
    for name in ("ready", "done0", "done2"):
        os.mkfifo(folder / name)
    heal = ("--standalone", "--heal", "--max-restarts=1")
    command = torchrun_command(3, "tests.e2e.heal_probe", torchrun_args=heal, launcher="ddp_core.torchrun")
    env = {"HEAL_PROBE_DIR": str(folder), "HEAL_PROBE_KILLS": str(kills), timeline.VARIABLE: str(folder / "timeline")}
    env = clean_env(PYTHONPATH=str(REPO), **env)  # run in ``folder``: a failure's report goes to its runs/failures
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def incarnations(folder: Path) -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(folder.glob("rank*.[0-9]"))}


def test_a_killed_worker_alone_is_replaced_and_told_it_is_a_replacement_and_where_the_lighthouse_is(tmp_path: Path):
    result = launch(tmp_path, kills=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = incarnations(tmp_path)
    assert sorted(found) == ["rank0.0", "rank1.0", "rank1.1", "rank2.0"], found  # ranks 0 and 2: one process each
    assert found["rank1.0"]["pid"] != found["rank1.1"]["pid"]
    assert {record["heal"] for record in found.values()} == {"1"}
    assert len({record["lighthouse"] for record in found.values()}) == 1
    assert found["rank1.1"]["answers"] is True, found["rank1.1"]
    events = timeline.read(tmp_path / "timeline")
    replaced = [
        (event["rank"], event["replacement"], event["code"]) for event in events if event["event"] == "replaced"
    ]
    assert replaced == [(1, 1, -9)]
    assert [event["rank"] for event in events if event["event"] == "warm"] == [1]  # forked from the warm parent
    assert "error" not in result.stderr, result.stderr[-3000:]


def test_with_the_replacements_spent_a_killed_worker_is_one_report_and_exit_137(tmp_path: Path):
    result = launch(tmp_path, kills=2)
    output = result.stdout + result.stderr
    assert result.returncode == 137, output[-4000:]
    assert sorted(incarnations(tmp_path)) == ["rank0.0", "rank1.0", "rank1.1", "rank2.0"]
    reports = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(reports) == 1 and reports[0].startswith("error: rank 1 (host "), output[-4000:]
    assert "killed by SIGKILL" in reports[0], reports
    assert len(list(tmp_path.glob("failure_node*.txt"))) == 1  # in the run directory its heartbeats named
