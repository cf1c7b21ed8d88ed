"""The two ways to start the same toy run on one machine, side by side: the project's launcher and the
experiments' own ``--nproc`` (torch.multiprocessing spawn, as the DDP tutorials do). They must cost about the
same: the spawn path sets torchrun's one OpenMP thread per process (``ddp_core.process.launch``).

    python -m bench.launch_paths                    # 5 rounds of 2 processes, 600 steps
    python -m bench.launch_paths --rounds 9 --nproc 3

Each round runs both, in alternating order, so machine noise falls on both alike. Reported per path: the wall
time of the command (start-up included) and the run's own samples/s (metrics.json: training steps only); then
the ratio spawn / launcher per round, its median and range.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.processes import child_env
from ddp_core.config import option
from ddp_core.layout import METRICS
from ddp_core.process.entry import command_main

PATHS = ("launcher", "spawn")


def command(path: str, nproc: int, steps: int, run_dir: Path) -> list[str]:
    toy = ["-m", "experiments.toy", "--steps", str(steps), "--run-dir", str(run_dir)]
    if path == "launcher":
        return [sys.executable, "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={nproc}", *toy]
    return [sys.executable, *toy, "--nproc", str(nproc)]


def one(path: str, nproc: int, steps: int, root: Path, index: int) -> tuple[float, float]:
    run_dir = root / f"{path}-{index}"
    began = time.perf_counter()
    # No OMP_NUM_THREADS here: setting each process's threads is what the spawn path must do itself.
    subprocess.run(command(path, nproc, steps, run_dir), check=True, capture_output=True, env=child_env())
    wall = time.perf_counter() - began
    return wall, json.loads((run_dir / METRICS).read_text())["samples_per_s"]


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


@dataclass
class LaunchPathsArgs:
    rounds: int = option(5, "rounds, each running both paths", minimum=1)
    nproc: int = option(2, "processes per run", minimum=2, maximum=64)
    steps: int = option(600, "toy optimizer steps per run", minimum=1)


def run_bench(args: LaunchPathsArgs) -> None:
    walls: dict[str, list[float]] = {path: [] for path in PATHS}
    speeds: dict[str, list[float]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="launch-paths-") as root:
        for index in range(args.rounds):
            for path in PATHS if index % 2 == 0 else PATHS[::-1]:
                wall, speed = one(path, args.nproc, args.steps, Path(root), index)
                walls[path].append(wall)
                speeds[path].append(speed)
    print(f"bench.launch_paths: the toy, {args.nproc} processes, {args.steps} steps, {args.rounds} rounds")
    for path in PATHS:
        print(f"  {path:8}  wall s {spread(walls[path])}  samples/s {spread(speeds[path])}")
    wall_ratio = [s / t for s, t in zip(walls["spawn"], walls["launcher"])]
    speed_ratio = [t / s for s, t in zip(speeds["spawn"], speeds["launcher"])]
    print(f"  spawn / launcher, wall time: {spread(wall_ratio)}")
    print(f"  spawn / launcher, time per sample: {spread(speed_ratio)}")


main = command_main(LaunchPathsArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
