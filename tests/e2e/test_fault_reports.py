"""Every fault is one report: fault x launch form at 3 processes, rank 1 hit at its 5th step.

Each row is one launch; it asserts the exit code, that the rank is named, and how many lines of ddp-lab's own
come beyond the training log (the raising rank's traceback, once, for an exception). The table's rows under
docker compose (a killed rank, a hang) are in tests/docker/test_engine.py, which has the image.
The launchers fork from tests/prefork.py's server (torch imported once), and so do the ``--nproc`` form's spawned
workers (through the stand-in, as spawn starts them); real spawned workers are in tests/e2e/test_launch_paths.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE, FAILED_EXIT_CODE, HUNG_EXIT_CODE
from tests import prefork
from tests.e2e.launch import REPO, run, torchrun_command

DIST_TIMEOUT_S = 5
TRAINING_LOG = re.compile(r"^\d\d:\d\d:\d\d \[rank \d+/\d+\] ")
FLAGS = ("--steps", "60", "--dataset-size", "256", "--checkpoint-every", "2", "--log-every", "100")

# fault: (FAULT, flags, exit code, what names the rank, at most lines of ddp-lab's own)
FAULTS = {
    "bad value": (None, ("--lr", "-1"), CONFIG_ERROR_EXIT_CODE, "--lr=-1", 1),
    "sigkill": ("sigkill", (), 137, "error: rank 1 (host ", 2),
    "exception": ("crash", (), FAILED_EXIT_CODE, "error: rank 1 (host ", 1),
    "hang": ("hang", (), HUNG_EXIT_CODE, "rank(s) 1 did not arrive", 5),  # the line, one per rank, the files
}


def launch(form: str, fault: str | None, run_dir: Path, flags: tuple[str, ...]):
    args = ("--run-dir", str(run_dir), *FLAGS, *flags)
    (run_dir.parent / "tmp").mkdir()  # the launch's temp folder: nothing of the launchers' is left in it
    env = {"DIST_TIMEOUT_S": str(DIST_TIMEOUT_S), "DIST_INIT_TIMEOUT_S": "300", "TMPDIR": str(run_dir.parent / "tmp")}
    if fault is not None:
        env.update(FAULT=fault, FAULT_RANK="1", FAULT_STEP="5")
    if form == "ddp_core.torchrun":
        module = ("tests.e2e.faulty", "experiments.toy") if fault else ("experiments.toy",)
        command = torchrun_command(3, *module, *args, launcher="ddp_core.torchrun")
    else:  # spawned workers never run faulty's __main__: its step faults come in through sitecustomize
        command = [prefork.python(), "-m", "experiments.toy", "--nproc", "3", *args]
        env["PYTHONPATH"] = f"{REPO / 'tests' / 'e2e' / 'fault_site'}:{REPO}"
    started = time.monotonic()
    result = run(command, timeout=240, **env)
    return result, time.monotonic() - started


@pytest.mark.parametrize("form", ["ddp_core.torchrun", "--nproc"])
@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_on_one_rank_is_one_report_with_its_stated_exit_code(tmp_path: Path, form: str, name: str):
    fault, flags, code, names_rank, most = FAULTS[name]
    result, took = launch(form, fault, tmp_path / "run", flags)
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-4000:]
    lines = [line for line in output.splitlines() if line.strip() and not TRAINING_LOG.match(line)]
    assert "ChildFailedError" not in output and "Root Cause" not in output, output[-4000:]
    if name == "exception":  # the raising rank's traceback once, then the line; no other rank's
        assert output.count("Traceback (most recent call last)") == 1, output[-6000:]
        assert "InjectedFault: injected fault on rank 1 at step 5" in output
        assert "PeerExitedError" not in output and "CollectiveTimeoutError" not in output
        lines = lines[lines.index(next(line for line in lines if "InjectedFault: injected" in line)) + 1 :]
    assert any(names_rank in line for line in lines), output[-4000:]
    assert len(lines) <= most, "\n".join(lines)
    left = [path.name for path in (tmp_path / "tmp").iterdir() if path.name.startswith(("torchelastic_", "ddp-lab-"))]
    assert left == [], left
    if fault is None:
        return
    report = next(line for line in lines if line.startswith("error: "))
    if name == "sigkill":
        assert "killed by SIGKILL after step 4" in report and "out-of-memory killer" in report, report
        assert str(tmp_path / "run" / "checkpoints" / "step_00000004.pt") in report, report
    if name == "hang":
        assert "flight recorder: " in output and "flight_recorder_rank_0" in output, output[-3000:]
        assert "rank 1: tests/e2e/faulty.py:" in output and "stacks_rank_N.txt" in output, output[-3000:]
        assert took < 120, took  # set-up, then DIST_TIMEOUT_S, the roll call and a 3 s grace: not 30 s more
    kept = sorted((tmp_path / "run").glob("failure_node*.txt"))
    assert [str(path) for path in kept] == [re.search(r"torch's full output: (\S+)", output).group(1)]
    if form == "ddp_core.torchrun":
        assert "ChildFailedError" in kept[0].read_text() or "FAILED" in kept[0].read_text()
