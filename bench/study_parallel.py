"""A study one run after another against the same study at ``--parallel``, side by side: the wall time of the
whole ``python -m tools.study`` command, and whether the runs' final weights are the same bits.

    python -m bench.study_parallel                  # the toy, 2 settings x 3 seeds, --nproc 1, 3 rounds
    python -m bench.study_parallel --rounds 5 --parallel 2 --steps 400

Each round runs both studies, each in a fresh runs folder, in alternating order, so machine noise falls on both
alike; reported: each one's wall time, then the ratio parallel / serial per round, its median and range. The
final weights (each run's newest checkpoint) of every round's runs are compared with the first round's serial
runs, tensor by tensor, for equality (torch.equal). Not in ``make bench``: about 4 study runs' time a round.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.processes import child_env
from ddp_core.config import option
from ddp_core.output.checkpoint import CheckpointDir
from ddp_core.process.entry import command_main

GRID = ("--seeds", "3", "--grid", "lr=0.05,0.2", "--nproc", "1")


def study(runs: Path, parallel: int, steps: int) -> float:
    command = [sys.executable, "-m", "tools.study", "toy", *GRID, "--runs-dir", str(runs)]
    command += ["--parallel", str(parallel), "--", "--steps", str(steps)]
    began = time.perf_counter()
    # CPU runs, OMP_NUM_THREADS left to the study (it gives each process one thread)
    env = {name: value for name, value in child_env(CUDA_VISIBLE_DEVICES="").items() if name != "OMP_NUM_THREADS"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"bench.study_parallel: the study exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - began


def final_weights(runs: Path) -> dict[str, dict[str, torch.Tensor]]:
    weights = {}
    for run_dir in sorted((runs / "studies").glob("*/*/seed-*")):
        newest = CheckpointDir.of_run(run_dir).newest()
        assert newest is not None, run_dir
        weights[run_dir.relative_to(runs).as_posix()] = torch.load(newest, weights_only=True)["model"]
    return weights


def same_bits(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        a[run].keys() == b[run].keys() and all(torch.equal(a[run][k], b[run][k]) for k in a[run]) for run in a
    )


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


@dataclass
class StudyParallelArgs:
    rounds: int = option(3, "rounds, each running both studies", minimum=1)
    parallel: int = option(2, "runs at once in the parallel study", minimum=2, maximum=64)
    steps: int = option(200, "toy optimizer steps per run", minimum=1)


def run_bench(args: StudyParallelArgs) -> None:
    modes = {"serial": 1, "parallel": args.parallel}
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    studies: list[tuple[str, dict[str, dict[str, torch.Tensor]]]] = []
    with tempfile.TemporaryDirectory(prefix="study-parallel-") as root:
        for index in range(args.rounds):
            for mode in list(modes) if index % 2 == 0 else list(modes)[::-1]:
                runs = Path(root) / f"{mode}-{index}"
                walls[mode].append(study(runs, modes[mode], args.steps))
                studies.append((mode, final_weights(runs)))
    reference = next(weights for mode, weights in studies if mode == "serial")
    equal = [same_bits(reference, weights) for _, weights in studies if weights is not reference]
    print(f"bench.study_parallel: the toy, 2 settings x 3 seeds, --nproc 1, {args.steps} steps, {args.rounds} rounds")
    for mode in modes:
        print(f"  {mode:8} (--parallel {modes[mode]})  wall s {spread(walls[mode])}")
    ratio = [p / s for p, s in zip(walls["parallel"], walls["serial"])]
    print(f"  parallel / serial, wall time: {spread(ratio)}")
    print(f"  final weights bitwise equal to round 0's serial runs: {sum(equal)} of {len(equal)} studies")


main = command_main(StudyParallelArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
