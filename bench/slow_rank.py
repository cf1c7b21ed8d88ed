"""The slow-rank warning's false alarms and detection: `python -m bench.slow_rank --runs 20`.

``--runs`` even toy runs (``ddp_core.torchrun --standalone``, ``--nproc`` processes, one torch thread each, no
fault) count the runs in which a rank was named (metrics.json's ``slow_ranks_named``): every one is a false
alarm. Then ``--slow-runs`` runs in which the last rank sleeps ``--sleep-ms`` in each optimizer step from step
``--slow-from`` on (tests/e2e/faulty.py's ``slow`` fault, as the e2e test injects it) count the log intervals
from the slowing to the warning. Each run writes into a temporary folder, removed after. Exit status 1 when an
even run named a rank or a slowed one was not named.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.processes import child_env
from ddp_core.config import option
from ddp_core.layout import METRICS
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]


@dataclass
class SlowRankArgs:
    runs: int = option(20, "even runs (no fault), each a false alarm if it names a rank", minimum=0)
    slow_runs: int = option(3, "runs with the last rank slowed, for the detection interval", minimum=0)
    nproc: int = option(3, "processes per run", minimum=2, maximum=64)
    steps: int = option(100, "toy optimizer steps per run", minimum=1)
    log_every: int = option(5, "steps per log interval", minimum=1)
    slow_from: int = option(31, "the slowed rank's first slow step", minimum=1)
    sleep_ms: float = option(20.0, "the slowed rank's sleep in each step, in milliseconds", above=0)
    timeout: float = option(300.0, "seconds before a run counts as hung", above=0)
    load: int = option(0, "busy processes beside the runs, as another test worker on a small machine", minimum=0)


def toy(args: SlowRankArgs, run_dir: Path, slowed: bool) -> dict[str, Any]:
    """One toy run's metrics.json (the slowed one through tests.e2e.faulty's injection)."""
    module = ["-m", "tests.e2e.faulty", "experiments.toy"] if slowed else ["-m", "experiments.toy"]
    command = [sys.executable, "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={args.nproc}", *module]
    flags = ["--run-dir", str(run_dir), "--steps", str(args.steps), "--log-every", str(args.log_every)]
    env = child_env(OMP_NUM_THREADS="1")
    if slowed:
        fault = {"FAULT": "slow", "FAULT_RANK": str(args.nproc - 1), "FAULT_STEP": str(args.slow_from)}
        env |= fault | {"FAULT_DELAY_S": str(args.sleep_ms / 1000)}
    flags += ["--dataset-size", "512", "--checkpoint-every", "0"]
    result = subprocess.run([*command, *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(f"toy run failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads((run_dir / METRICS).read_text())


@contextlib.contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` Python loops spinning beside the runs: the CPU is contended, as in a parallel test suite."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def measure(args: SlowRankArgs) -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]]]:
    even, slowed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-slow-rank-") as folder, busy(args.load):
        for i in range(args.runs):
            even.append(toy(args, Path(folder) / f"even{i}", slowed=False)["slow_ranks_named"])
            print(f"even run {i + 1}/{args.runs}: {even[-1] or 'no rank named'}", flush=True)
        for i in range(args.slow_runs):
            slowed.append(toy(args, Path(folder) / f"slow{i}", slowed=True)["slow_ranks_named"])
            print(f"slowed run {i + 1}/{args.slow_runs}: {slowed[-1] or 'no rank named'}", flush=True)
    return even, slowed


def intervals_to_warning(args: SlowRankArgs, named: list[dict[str, Any]]) -> int | None:
    """Log intervals from the slowing to the warning (3 at the soonest), for the slowed rank's first naming."""
    first = next((entry for entry in named if entry["rank"] == args.nproc - 1), None)
    if first is None:
        return None
    slowed_in = (args.slow_from - 1) // args.log_every  # the interval (0-based) whose steps first include it
    return first["step"] // args.log_every - slowed_in


def run_bench(args: SlowRankArgs) -> None:
    started = time.perf_counter()
    even, slowed = measure(args)
    alarms = sum(bool(named) for named in even)
    detected = [intervals_to_warning(args, named) for named in slowed]
    found = [n for n in detected if n is not None]
    others = sum(any(entry["rank"] != args.nproc - 1 for entry in named) for named in slowed)
    print(
        f"\nSlow-rank warning, toy at {args.nproc} processes, {args.steps} steps, --log-every {args.log_every} "
        f"({args.steps // args.log_every} intervals a run), {args.load} busy processes beside, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print("| runs | rank named | detection (log intervals from the slowing to the warning) |")
    print("|---|---|---|")
    print(f"| {args.runs} even | {alarms} (false alarms) | - |")
    if args.slow_runs:
        spread = f"median {statistics.median(found):g}, min {min(found)}, max {max(found)}" if found else "-"
        print(
            f"| {args.slow_runs} with rank {args.nproc - 1} sleeping {args.sleep_ms:g} ms a step from step "
            f"{args.slow_from} | {len(found)} of {args.slow_runs} (another rank: {others}) | {spread} |"
        )
    if alarms or len(found) < args.slow_runs:
        raise SystemExit(1)


main = command_main(SlowRankArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
