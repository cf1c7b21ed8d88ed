"""A hang names each rank's Python line (ddp_core.distributed.stacks): one launch per case feeds every assertion.

Rank 1 of 3 sleeps in an optimizer step hook; rank 1 of 2 waits on its DataLoader, whose worker sleeps in
``__getitem__`` (tests/e2e/stuck_rank.py). The report names each rank's innermost frame of its own code and
the collective the others waited in, a few lines beyond the training log, and the stacks are in the run directory.
The loader's case runs real processes (not tests/prefork.py's forks): there torchrun ends a worker's whole process
group, the loader's worker included, and the test sees no process of the job left.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ddp_core.exit_codes import HUNG_EXIT_CODE
from tests.e2e.launch import run, torchrun_command

TRAINING_LOG = re.compile(r"^\d\d:\d\d:\d\d \[rank \d+/\d+\] ")
FIXTURE = "tests/e2e/stuck_rank.py"
CASES = {  # case: processes, DIST_TIMEOUT_S, the stuck step, a real interpreter, rank 1's line
    "hook": (3, 20, 5, False, rf"rank 1: {FIXTURE}:\d+ sleep_in_the_hook \(no collective\)"),
    "loader": (2, 10, 3, True, rf"rank 1: {FIXTURE}:\d+ __getitem__ in a DataLoader worker \(no collective\)"),
}


def processes_of(run_dir: Path) -> list[int]:
    """The processes whose command line names ``run_dir``: the job's workers and the processes they forked."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # it ended while we looked
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_a_hang_names_each_rank_s_line_and_keeps_every_stack(tmp_path: Path, case: str, request: pytest.FixtureRequest):
    nproc, timeout_s, step, real, stuck = CASES[case]
    run_dir = tmp_path / "run"
    # The launch's temp folder, short: a DataLoader's worker binds a socket there (AF_UNIX: 107 bytes at most)
    tmp = Path(tempfile.mkdtemp(prefix="hang-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    flags = ("--run-dir", str(run_dir), "--steps", "60", "--dataset-size", "256", "--log-every", "100")
    command = torchrun_command(
        nproc, "tests.e2e.stuck_rank", *flags, launcher="ddp_core.torchrun", python=sys.executable if real else None
    )
    env = {"STUCK": case, "STUCK_RANK": "1", "STUCK_STEP": str(step), "TMPDIR": str(tmp)}
    result = run(command, timeout=240, DIST_TIMEOUT_S=str(timeout_s), DIST_INIT_TIMEOUT_S="300", **env)
    output = result.stdout + result.stderr
    assert result.returncode == HUNG_EXIT_CODE, output[-4000:]
    lines = [line for line in output.splitlines() if line.strip() and not TRAINING_LOG.match(line)]
    assert len(lines) <= 10 and lines[0].startswith("error: rank 0: a collective timed out"), "\n".join(lines)
    ranks = [line for line in lines if line.startswith("rank ")]
    assert len(ranks) == nproc and re.fullmatch(stuck, ranks[1]), "\n".join(lines)
    waited = re.search(r"the others waited: ranks? [\d, ]+ in (all_reduce #\d+ \(sizes \[\[\d+\]\]\))", lines[0])
    for line in ranks[:1] + ranks[2:]:  # the others: their frame of ddp-lab's, in the collective rank 1 never joined
        assert re.fullmatch(rf"rank \d: ddp_core/\S+\.py:\d+ \w+, in {re.escape(waited[1])}", line), "\n".join(lines)
    assert lines[-1].startswith("flight recorder: ") and f"each rank's stacks: {run_dir}/stacks_rank_N.txt" in lines[-1]
    for rank, line in enumerate(ranks):
        text = (run_dir / f"stacks_rank_{rank}.txt").read_text()
        assert text.startswith(line + "\n\n") and "(most recent call first):" in text
    if case == "loader":  # the worker's own stack follows the rank's
        assert "--- process " in (run_dir / "stacks_rank_1.txt").read_text()
    assert [path.name for path in tmp.iterdir() if path.name.startswith(("torchelastic_", "ddp-lab-"))] == []
    deadline = time.monotonic() + 30
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the processes' state: the condition decides
    assert processes_of(run_dir) == []
