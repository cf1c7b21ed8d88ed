"""Teardown stress: N short four-process toy runs and N plain-PyTorch control runs, alternating.

    python -m bench.stress --runs 200                      # make stress N=200
    python -m bench.stress --runs 200 --launcher spawn     # the test harness's spawn path, leave vs return
    python -m bench.stress --runs 200 --launcher refusal   # a refused --resume says why in its last line

Each run is ``torchrun --standalone --nproc-per-node=4`` (a free port each time), one torch thread per
process. The toy trains a few steps into its own run directory (a temporary folder, removed after);
the control (``bench.teardown_control``) is the plain-torch script of docs/design.md, "Gloo teardown". A run fails when
torchrun exits non-zero or outlives ``--timeout``. Runs alternate (toy, control, toy, ...) so that the
machine's load hits both alike. The summary gives each side's failures out of N, grouped by torchrun's
exit code, the workers' exit codes and the first distinctive stderr line (e.g. "terminate called
without an active exception", torch 2.14.1's gloo teardown abort). Exit status 1 when a toy run failed:
ddp-lab's workers must never turn finished work into a failed job; the control is expected to fail now
and then.

``--launcher spawn`` measures the other way ddp-lab starts processes, torch.multiprocessing's spawn (the
test harness, and ``--nproc`` without torchrun): ``bench.spawn_teardown`` with children that leave
through ``ddp_core.process.exit.leave`` against children that return (the "before"). Exit status 1 when
a leaving run failed.

``--launcher refusal`` measures how a run refused for its configuration ends: ``--nproc`` toy workers
(through ``ddp_core.torchrun``) resume a run stopped at step 3 with another ``--lr``. Every rank raises
the same error and rank 0 prints it; the run fails unless it exits 2 with that one line as stderr's
last. Before the fix, torchrun sometimes saw one worker leave first and logged closing the other after
the line. Exit status 1 when a run failed.

``--launcher diverged`` measures the report of a run stopped by the replica check (``bench.perturbed_replica``:
rank N-1's weight perturbed after step 6, checks every 4 steps, a checkpoint every 5): a run fails unless it
exits 5 with one line, the last, that names the checkpoint of step 5 to resume from. Before the fix the line
sometimes said no checkpoint had been written, when step 5's write was still in flight at step 8's check;
``--slow-write 2`` makes every write that slow (a slow disk).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.processes import child_env
from ddp_core.config import option, require
from ddp_core.errors import RunStoppedError
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE, REPLICAS_DIVERGED_EXIT_CODE
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]
# Set by a launcher around this command (torchrun, a test runner): a child torchrun must not inherit them.
# torchrun's own log lines (not the workers'): level, date, time, pid, file:line]
TORCHRUN_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d[^\]]*\]\s?")
WORKER_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)  # torchrun's failure summary


@dataclass
class StressArgs:
    runs: int = option(200, "runs of each side (toy and control)")
    nproc: int = option(4, "processes per run")
    steps: int = option(5, "toy optimizer steps per run")
    timeout: float = option(120.0, "seconds before a run counts as hung and is killed")
    launcher: str = option(
        "torchrun",
        "torchrun: the toy against the plain-torch control; spawn: torch.multiprocessing children "
        "that leave through ddp_core against children that return; refusal: a resume refused "
        "for its configuration",
        choices=("torchrun", "spawn", "refusal", "diverged"),
    )
    slow_write: float = option(0.0, "diverged: seconds each checkpoint write takes more (a slow disk)", minimum=0.0)


@dataclass(frozen=True)
class Failure:
    exit_code: int  # torchrun's; -9 after a timeout kill
    worker_codes: tuple[int, ...]  # from torchrun's summary, root cause first
    first_line: str


def distinctive_line(stderr: str) -> str:
    """The first stderr line that is not torchrun's own logging: what the failing worker said first."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if not TORCHRUN_LOG_LINE.match(line) and not line.startswith("Traceback")]
    return (own or lines or ["(nothing on stderr)"])[0][:160]


def run_once(
    command: list[str], env: dict[str, str], timeout: float, expected: int = 0, must_say: str = ""
) -> Failure | None:
    """One launch; None when it exited ``expected`` (for a stated code, with one "error:" line, the last, that
    holds ``must_say``). Its own process group, so a hung run's workers die with it."""
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        return Failure(
            process.returncode,
            (),
            f"timed out after {timeout:g} s; last stderr line: {distinctive_line(stderr[-2000:])}",
        )
    if process.returncode == expected == 0:
        return None
    if process.returncode == expected:
        lines = stderr.rstrip().splitlines()
        said = [line for line in lines if line.startswith("error: ")]
        if len(said) == 1 and lines[-1] == said[0]:
            if must_say in said[0]:
                return None
            return Failure(process.returncode, (), f"the line lacks {must_say!r}: {said[0][:140]}")
        last = TORCHRUN_LOG_LINE.sub(
            "torchrun: ", (lines or ["(none)"])[-1]
        )  # without its time stamp: alike failures group
        return Failure(process.returncode, (), f"{len(said)} error line(s); last stderr line: {last[:140]}")
    codes = tuple(int(code) for code in WORKER_EXIT_CODE.findall(stderr))
    root_cause_first = codes[-1:] + codes[:-1]  # torchrun lists the root cause last
    return Failure(process.returncode, root_cause_first, distinctive_line(stderr))


def describe(failures: list[Failure]) -> list[str]:
    counted = collections.Counter(failures)
    return [
        f"      {count} x exit {f.exit_code} (workers: {', '.join(map(str, f.worker_codes)) or 'n/a'}): {f.first_line}"
        for f, count in counted.most_common()
    ]


TOY_TO_REFUSE = (
    "--steps",
    "12",
    "--batch-size",
    "16",
    "--dataset-size",
    "256",
    "--checkpoint-every",
    "4",
    "--log-every",
    "4",
)


TOY_TO_DIVERGE = (
    *("--steps", "12", "--batch-size", "8", "--dataset-size", "240", "--log-every", "3"),
    *("--check-replicas-every", "4", "--checkpoint-every", "5"),
)


def commands(args: StressArgs, folder: Path, i: int) -> dict[str, list[str]]:
    """Run ``i``'s sides: ddp-lab's way first, then its control (none for a refusal or a divergence)."""
    launcher = [sys.executable, "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={args.nproc}", "-m"]
    if args.launcher == "diverged":
        diverged = ["bench.perturbed_replica", "experiments.toy", "--run-dir", str(folder / f"diverged-{i}")]
        return {"diverged": [*launcher, *diverged, *TOY_TO_DIVERGE]}
    if args.launcher == "refusal":
        refused = [*launcher, "experiments.toy", "--run-dir", str(folder / "stopped"), *TOY_TO_REFUSE]
        return {"refusal": [*refused, "--lr", "0.5", "--resume"]} if i else {"stop": [*refused, "--stop-at-step", "3"]}
    if args.launcher == "spawn":
        spawn = [sys.executable, "-m", "bench.spawn_teardown", "--nproc", str(args.nproc)]
        return {"leave": [*spawn, "--exit", "leave"], "return": [*spawn, "--exit", "return"]}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return {
        "toy": [
            *torchrun,
            "-m",
            "experiments.toy",
            "--steps",
            str(args.steps),
            "--log-every",
            str(args.steps),
            "--run-dir",
            str(folder / f"toy-{i}"),
        ],
        "control": [*torchrun, "-m", "bench.teardown_control"],
    }


def stress(args: StressArgs) -> dict[str, list[Failure]]:
    env = child_env(OMP_NUM_THREADS="1")
    failures: dict[str, list[Failure]] = {}
    started = time.monotonic()
    expected = {"refusal": CONFIG_ERROR_EXIT_CODE, "diverged": REPLICAS_DIVERGED_EXIT_CODE}.get(args.launcher, 0)
    must_say = "--resume continues from " if args.launcher == "diverged" else ""
    if args.launcher == "diverged":  # the last rank's replica, after step 6: caught by step 8's check
        env.update(
            PERTURB_RANK=str(args.nproc - 1),
            PERTURB_STEP="6",
            PERTURB_NAME="net2.bias",
            SLOW_WRITE_S=str(args.slow_write),
        )
    with tempfile.TemporaryDirectory(prefix="ddp-lab-stress-") as folder:
        if (
            args.launcher == "refusal"
        ):  # the run every refusal is asked to continue; a refused resume changes nothing in it
            failure = run_once(commands(args, Path(folder), 0)["stop"], env, args.timeout)
            if failure is not None:
                raise RunStoppedError(
                    f"the run to refuse did not stop at step 3: exit {failure.exit_code}, {failure.first_line}"
                )
        for i in range(1, args.runs + 1):
            for side, command in commands(args, Path(folder), i).items():
                failures.setdefault(side, [])
                failure = run_once(command, env, args.timeout, expected, must_say)
                if failure is not None:
                    failures[side].append(failure)
                    print(f"   run {i}: {side} failed: exit {failure.exit_code}, {failure.first_line}", flush=True)
            if i % 10 == 0 or i == args.runs:
                counts = ", ".join(f"{side} {len(failed)} failed" for side, failed in failures.items())
                print(f"   {i}/{args.runs} in {time.monotonic() - started:.0f} s: {counts}", flush=True)
    return failures


def run_bench(args: StressArgs) -> int:
    require(args.runs >= 1 and args.nproc >= 1 and args.steps >= 1, "--runs, --nproc and --steps must be >= 1")
    require(args.timeout > 0, f"--timeout={args.timeout} must be > 0 seconds")
    require(
        args.launcher != "diverged" or args.nproc >= 2, "--launcher diverged needs --nproc >= 2 (replicas to compare)"
    )
    if args.launcher == "refusal":
        labels = {"refusal": "toy resumed with another --lr (exit 2, its line last)"}
    elif args.launcher == "diverged":
        labels = {"diverged": f"perturbed toy (exit 5 naming step 5's checkpoint), writes {args.slow_write:g} s slower"}
    elif args.launcher == "spawn":
        labels = {
            "leave": "spawned children that leave (ddp_core.process.exit)",
            "return": "spawned children that return (finalization)",
        }
    else:
        labels = {
            "toy": f"ddp-lab toy (experiments.toy --steps {args.steps})",
            "control": "plain-PyTorch control (bench.teardown_control)",
        }
    sides = " and ".join(f"{args.nproc}-process {side}" for side in labels)
    print(
        f"teardown stress ({args.launcher}): {args.runs} x ({sides}){', alternating' if len(labels) > 1 else ''};"
        f" torch {torch.__version__}, {os.cpu_count()} CPU cores",
        flush=True,
    )
    failures = stress(args)
    print("\nResult:")
    for side, label in labels.items():
        print(f"   {label:50s} {len(failures[side])} of {args.runs} failed")
        print("\n".join(describe(failures[side])) or "      -")
    return 1 if failures[next(iter(labels))] else 0  # ddp-lab's side; the control may fail


main = command_main(StressArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
