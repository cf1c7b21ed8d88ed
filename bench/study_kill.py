"""A study killed with SIGKILL to its process group (``kill -9``, a scheduler's hard stop), then read at once as
the next start of the same command reads it: which runs still read "running", and for how long.

    python -m bench.study_kill --trials 20

Each trial starts ``python -m tools.study toy`` (2 settings x 3 seeds, ``--nproc 1``, ``--parallel 2``, 300
steps a run, a checkpoint every 50) in a session of its own, in a fresh runs folder. Once the study's third run
(lr=0.05, seed 2) has written its step-50 checkpoint, the whole process group gets SIGKILL, and every run's state
is read every 10 ms (``ddp_core.runs.read_run``, as the next start reads it: a run whose process is still there
reads "running", and that start is refused until it is gone). Counted: the trials in which another run still read
"running" at the moment the watched one stopped doing so (a start made then was refused: what the e2e test's wait
for the watched run alone let through), and the time until no run read "running". Exit status 1 when a run still
read "running" after ``--timeout``. Not in ``make bench``: about 10 s a trial.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.processes import child_env
from ddp_core.config import option
from ddp_core.layout import CHECKPOINTS, step_file_name
from ddp_core.process.entry import command_main
from ddp_core.runs import read_run

STUDY = ("toy", "--seeds", "3", "--grid", "lr=0.05,0.2", "--nproc", "1", "--parallel", "2")
RUN = ("--", "--steps", "300", "--dataset-size", "256", "--checkpoint-every", "50", "--log-every", "100")
WATCHED, AT_STEP = Path("lr=0.05") / "seed-2", 50
POLL_S = 0.01


@dataclass
class StudyKillArgs:
    trials: int = option(20, "studies started and killed", minimum=1)
    timeout: float = option(60.0, "seconds after the kill before a run still reading running is a failure", minimum=1)


@dataclass
class Trial:
    others_running: list[str]  # when the watched run stopped reading "running"
    all_gone_s: float | None  # after the kill; None: not within the timeout


def running(root: Path) -> list[Path]:
    return [path for path in sorted(root.glob("*/seed-*")) if read_run(path, path.name).status == "running"]


def trial(runs: Path, timeout: float) -> Trial:
    root = runs / "studies" / "toy-lr"
    command = [sys.executable, "-m", "tools.study", *STUDY, "--runs-dir", str(runs), *RUN]
    env = {name: value for name, value in child_env(CUDA_VISIBLE_DEVICES="").items() if name != "OMP_NUM_THREADS"}
    study = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    checkpoint = root / WATCHED / CHECKPOINTS / step_file_name(AT_STEP)
    try:
        while not checkpoint.exists():
            if study.poll() is not None:
                raise SystemExit(f"the study ended (exit {study.returncode}) before {checkpoint} was written")
            time.sleep(POLL_S)  # polling a file: the condition decides
    finally:
        os.killpg(study.pid, signal.SIGKILL)
        study.wait()
    killed = time.monotonic()
    others: list[str] | None = None
    while (still := running(root)) and time.monotonic() - killed < timeout:
        if others is None and root / WATCHED not in still:
            others = [str(path.relative_to(root)) for path in still]
        time.sleep(POLL_S)
    return Trial(others or [], None if still else time.monotonic() - killed)


def run_bench(args: StudyKillArgs) -> int:
    print(f"study killed with its process group: {args.trials} trials, {os.cpu_count()} CPU cores", flush=True)
    trials = []
    for number in range(1, args.trials + 1):
        with tempfile.TemporaryDirectory(prefix="ddp-lab-study-kill-") as runs:
            result = trial(Path(runs), args.timeout)
        trials.append(result)
        gone = f"{result.all_gone_s:.2f} s" if result.all_gone_s is not None else f"not within {args.timeout:g} s"
        print(
            f"   trial {number}: others running when the watched run was not: {result.others_running or 'none'}; "
            f"none running after {gone}",
            flush=True,
        )
    raced = sum(bool(result.others_running) for result in trials)
    stuck = sum(result.all_gone_s is None for result in trials)
    times = [result.all_gone_s for result in trials if result.all_gone_s is not None]
    spread = f"median {statistics.median(times):.2f} s, max {max(times):.2f} s" if times else "none"
    print(
        f"\nResult: another run still running when the watched one was not: {raced} of {args.trials}; "
        f"no run running after: {spread}; still running after {args.timeout:g} s: {stuck} of {args.trials}"
    )
    return 1 if stuck else 0


main = command_main(StudyKillArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
