"""``--launcher slurm``: the study's unfinished runs as one Slurm job array through the project's batch script,
which reads task N's run directory and flags from line N+1 of ``STUDY_TASKS``; the study waits for the array."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ddp_core.errors import ConfigError
from ddp_core.layout import METRICS
from tools.study.local import Ending, last_line

SLURM_POLL_S = 5.0  # how often squeue is asked whether the array is done

if TYPE_CHECKING:
    from tools.study.grid import Study, Task


DEFAULT_EXPORT = re.compile(r"^\s*export\s+([A-Z_][A-Z0-9_]*)=\$\{\1:-([^$}]*)\}\s*$")


def script_defaults(script: str) -> dict[str, str]:
    """The batch script's plain defaults (``export BACKEND=${BACKEND:-gloo}``), which its runs see: the study parses
    their flags with them too."""
    try:
        lines = Path(script).read_text().splitlines()
    except OSError:
        return {}
    return {m.group(1): m.group(2) for m in map(DEFAULT_EXPORT.match, lines) if m and m.group(1) != "RUN_DIR"}


def task_lines(study: Study, todo: list[Task], where: Callable[[Path], str] | None = None) -> list[str]:
    """One tab-separated line per task: its run directory as the task sees it (default: absolute), its flags."""
    lines = []
    for task in todo:
        run_dir = where(task.run_dir) if where else str(task.run_dir.resolve())
        fields = [run_dir, *study.flags, *task.combination.argv, "--seed", str(task.seed)]
        # The script splits on tabs with bash's read, which also merges empty fields: an empty flag would shift.
        if any("\t" in item or "\n" in item or not item for item in fields):
            raise ConfigError(
                f"{task.label}: a flag is empty or holds a tab or a newline, which a Slurm task line cannot carry"
                " (use --flag=VALUE)"
            )
        lines.append("\t".join(fields))
    return lines


def submit(study: Study, todo: list[Task], script: str, options: list[str], parallel: int | None) -> str:
    if not Path(script).is_file():
        raise ConfigError(f"--sbatch-script {script}: no such file (docker/slurm.sbatch or docker/slurm-cpu.sbatch)")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    tasks = (study.dir / f"slurm-tasks-{stamp}.tsv").resolve()
    tasks.write_text("\n".join(task_lines(study, todo)) + "\n")
    logs = (study.dir / "logs").resolve()
    command = [
        "sbatch",
        "--parsable",
        f"--array=0-{len(todo) - 1}" + (f"%{parallel}" if parallel else ""),  # %N: at most N tasks at once
        f"--job-name=study-{study.name}",
        f"--output={logs}/slurm-%A_%a.out",
        *options,
        script,
    ]
    env = {**os.environ, "EXPERIMENT": study.experiment, "NPROC": str(study.nproc), "STUDY_TASKS": str(tasks)}
    env.pop("RUN_DIR", None)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError("--launcher slurm: sbatch is not on PATH (run it on a Slurm login node)") from None
    if done.returncode != 0:
        raise ConfigError(f"sbatch exited {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout.strip().split(";")[0]


def queued(array: str) -> bool:
    """Any task of the array still pending, running or requeued."""
    shown = subprocess.run(
        ["squeue", "--noheader", "--array", "--jobs", array, "--format=%i"], capture_output=True, text=True, timeout=60
    )
    if shown.returncode != 0:  # a job that left the queue long ago is unknown to squeue: done
        return "Invalid job id" not in shown.stderr  # another error (slurmctld busy): ask again
    return bool(shown.stdout.strip())


def run_slurm(study: Study, todo: list[Task], script: str, options: list[str], parallel: int | None) -> list[Ending]:
    array = submit(study, todo, script, options, parallel)
    print(
        f"study {study.name}: job array {array}, {len(todo)} task(s) ({script}); logs {study.dir}/logs/"
        f"slurm-{array}_N.out. Stopping here leaves it running: the same command collects the results.",
        file=sys.stderr,
    )
    with open(study.dir / "slurm-arrays.txt", "a") as record:
        record.write(f"{array}\t{len(todo)}\n")
    logs = study.dir / "logs"
    return wait_for(study, todo, lambda: queued(array), lambda index: logs / f"slurm-{array}_{index}.out", SLURM_POLL_S)


def wait_for(
    study: Study, todo: list[Task], busy: Callable[[], bool], log_of: Callable[[int], Path], poll_s: float
) -> list[Ending]:
    """A scheduler's runs: a progress bar while ``busy()``, then the runs that did not finish (task N's log:
    ``log_of(N)``)."""
    from tqdm import tqdm

    from tools.study.grid import state_after

    done = len(study.tasks) - len(todo)
    with tqdm(total=len(study.tasks), initial=done, unit="run", desc=study.name, file=sys.stderr) as bar:
        while busy():
            bar.update(done + sum((task.run_dir / METRICS).exists() for task in todo) - bar.n)
            time.sleep(poll_s)
        endings = []
        for index, task in enumerate(todo):
            task.state = state_after(task, 0)
            if task.state != "finished":
                log = log_of(index)
                endings.append(Ending(task.label, task.state, None, last_line(log), log))
        bar.update(len(study.tasks) - bar.n)
    return endings
