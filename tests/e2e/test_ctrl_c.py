"""Ctrl-C to ddp-lab's launcher, as a terminal sends it (SIGINT to the launcher's process group; each worker has a
session of its own, so only the launcher gets it and passes the stop on): a short report at any moment.

During start-up (the launcher still importing torch, or the workers spawned and importing) at most 4 lines, no
traceback, no checkpoint promised (none exists), exit 130; once training, the workers stop after the step in
progress and the line names the checkpoint they wrote, exit 143.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from ddp_core.exit_codes import KILLED_EXIT_CODE_BASE, STOPPED_EXIT_CODE
from ddp_core.output.checkpoint import CheckpointDir
from ddp_core.process import timeline
from tests.e2e.launch import REPO, clean_env, torchrun_command
from tests.e2e.test_launch_paths import wait_for

TOY = ("experiments.toy", "--steps", "100000000", "--log-every", "10", "--checkpoint-every", "100000000")


def interrupted(tmp_path: Path, ready) -> tuple[int, str, str]:
    """The toy at 2 processes under ddp_core.torchrun (real interpreters: tests.prefork's would skip the imports),
    SIGINT to the launcher's process group once ``ready(timeline events, output so far)``; returns the exit code,
    the output before the signal and the output after it."""
    events, log = tmp_path / "timeline.jsonl", tmp_path / "output.txt"
    command = torchrun_command(2, *TOY, "--run-dir", str(tmp_path / "run"), launcher="ddp_core.torchrun")
    command[0] = sys.executable
    env = clean_env(**{timeline.VARIABLE: str(events)})
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_for(lambda: ready(timeline.read(events), log.read_text()), 120, "the launch's ready point")
            before = log.read_text()
            os.killpg(process.pid, signal.SIGINT)
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = log.read_text()
    assert text.startswith(before)
    return code, before, text[len(before) :]


def test_ctrl_c_during_start_up_is_one_short_report_with_no_traceback_and_no_checkpoint_promised(tmp_path: Path):
    code, before, after = interrupted(tmp_path, lambda events, _: any(e["event"] == "spawned" for e in events))
    lines = after.splitlines()
    assert len(lines) <= 4 and "Traceback" not in after and "KeyboardInterrupt" not in after, before + after
    assert code == KILLED_EXIT_CODE_BASE + signal.SIGINT, before + after  # 130, as a shell reports a Ctrl-C
    assert "checkpoint is" not in after and "--resume" not in after, after
    assert lines[-1].startswith("stopped: torchrun got SIGINT") and "relaunch to start over" in lines[-1], after
    assert not (tmp_path / "run").exists() or CheckpointDir.of_run(tmp_path / "run").newest() is None


def test_ctrl_c_while_the_launcher_imports_torch_is_the_same_short_report(tmp_path: Path):
    """As soon as the launcher's handler is in place, before torch is imported: wherever in start-up the signal
    lands (the import, the rendezvous, the workers' start), the report is the same."""
    code, before, after = interrupted(tmp_path, lambda events, _: any(e["event"] == "launcher" for e in events))
    lines = after.splitlines()
    assert len(lines) <= 4 and "Traceback" not in after and "KeyboardInterrupt" not in after, before + after
    assert code == KILLED_EXIT_CODE_BASE + signal.SIGINT, before + after
    assert lines[-1].startswith("stopped: torchrun got SIGINT") and "relaunch to start over" in lines[-1], after
    assert not (tmp_path / "run").exists() or CheckpointDir.of_run(tmp_path / "run").newest() is None


def test_ctrl_c_while_training_names_the_checkpoint_the_workers_wrote(tmp_path: Path):
    code, before, after = interrupted(tmp_path, lambda _, out: re.search(r"step \d+/100000000", out) is not None)
    newest = CheckpointDir.of_run(tmp_path / "run").newest()
    assert code == STOPPED_EXIT_CODE and newest is not None, before + after
    assert "Traceback" not in after, after
    last = after.splitlines()[-1]
    assert last.startswith("stopped: torchrun got SIGINT") and f"the last checkpoint is {newest}" in last, after
    assert f"--resume --run-dir {tmp_path / 'run'}" in last, last
    assert not (tmp_path / "run" / "metrics.json").exists()
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["exit_code"] == STOPPED_EXIT_CODE
