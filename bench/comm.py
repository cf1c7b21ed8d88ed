"""DDP's communication knobs against plain DDP: `python -m bench.comm` (part of `make bench`).

For CIFAR10 (the small CNN, on generated stand-in images) and charlm, each of ``--comm-hook fp16``,
``--comm-hook bf16``, ``--comm-hook powersgd`` and ``--zero`` against ``--comm-hook none``, every run a
real training run through the project's launcher (``python -m ddp_core.torchrun --standalone
--nproc-per-node=N``), each in its own run directory. Per variant:

- bytes all-reduced per optimizer step by one rank: metrics.json's ``comm_bytes_per_step``, counted
  where the hook sends them ("n/a" where this ddp_core does not write it);
- step time ÷ none's: rank 0's training time per step (metrics.json's throughput: set-up, evaluation and
  checkpoints excluded), divided by none's in the same round; median and min–max over the rounds;
- the optimizer state each rank holds (bench.comm_probe measures it in the training processes);
- the final ``eval_accuracy`` (CIFAR10) or ``eval_loss`` (charlm), mean ± sd over the seeds.

Side by side: round r runs every variant of every experiment once, with seed r (modulo --seeds), the
variants' order rotated each round, so that machine noise and drift hit them alike. Output: a markdown
table (bench/comm_table.py), or --json. --keep DIR keeps the runs and their logs; a failed run's are
always kept.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.comm_probe import PROBE_FILE
from bench.comm_table import BASELINE, RunResult, as_json, markdown, summarize
from bench.processes import child_env, run_in_own_session
from ddp_core import layout
from ddp_core.config import option, require
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "none": ("--comm-hook", "none"),
    "fp16": ("--comm-hook", "fp16"),
    "bf16": ("--comm-hook", "bf16"),
    "powersgd": ("--comm-hook", "powersgd"),
    "zero": ("--comm-hook", "none", "--zero"),
}
EXPERIMENTS = ("cifar10", "charlm")
METRICS = {"cifar10": "eval_accuracy", "charlm": "eval_loss"}  # each one's headline, read from metrics.json
THROUGHPUT = {"cifar10": "images_per_s", "charlm": "samples_per_s"}  # the unit each one's plan counts in
CIFAR_BATCH, CIFAR_TEST_IMAGES = 32, 500


def _names(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


def names_problem(known: tuple[str, ...], need: str | None = None) -> Callable[[str], str | None]:
    """The check of a comma-separated list of names from ``known``, each once, ``need`` among them."""

    def problem(value: str) -> str | None:
        names = _names(value)
        if any(name not in known for name in names):
            return "names an unknown one"
        if len(set(names)) != len(names):
            return "names one twice"
        if need is not None and need not in names:
            return f"leaves out {need!r}, the baseline"
        return None

    return problem


@dataclass
class CommBenchArgs:
    nproc: int = option(2, "processes per run", minimum=2, maximum=64, note="one process all-reduces nothing")
    experiments: str = option(
        ",".join(EXPERIMENTS),
        "experiments to run, comma-separated",
        check=names_problem(EXPERIMENTS),
        accepts=f"comma-separated names from {', '.join(EXPERIMENTS)}, each once",
    )
    variants: str = option(
        ",".join(VARIANTS),
        "variants to run, comma-separated",
        check=names_problem(tuple(VARIANTS), need=BASELINE),
        accepts=f"comma-separated names from {', '.join(VARIANTS)}, each once, {BASELINE} among them",
    )
    seeds: int = option(3, "seeds 0..N-1; the final metric's mean ± sd is over them", minimum=1, maximum=1000)
    rounds: int = option(
        0, "rounds of every run (0: one per seed); round r runs seed r modulo --seeds", minimum=0, maximum=1000
    )
    cifar_images: int = option(640, "generated CIFAR10 training images", minimum=64, maximum=1_000_000)
    cifar_epochs: int = option(2, "CIFAR10 epochs (steps: images // (32 x --nproc) each)", minimum=1, maximum=1000)
    charlm_steps: int = option(60, "charlm optimizer steps", minimum=2, maximum=1_000_000)
    powersgd_start_step: int = option(
        2, "PowerSGD's plain all-reduce steps before it compresses (the experiments' default is 10)", minimum=2
    )
    keep: str = option(
        "", "folder to keep the runs and logs in (default: a temporary one, removed at the end)", path="dir"
    )
    timeout: float = option(600.0, "seconds before a run counts as hung and is stopped", above=0)
    json: bool = option(False, "print the results as JSON instead of a markdown table")

    @property
    def round_count(self) -> int:
        return self.rounds or self.seeds


@dataclass(frozen=True)
class Job:
    experiment: str
    variant: str
    round: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.experiment}-{self.variant}-round{self.round}"


def schedule(experiments: list[str], variants: list[str], rounds: int, seeds: int) -> list[Job]:
    """Every round, every experiment's every variant once; the variants' order rotated by one each round, so
    that none always runs first (a cold cache) or right after the same neighbour."""
    jobs = []
    for r in range(rounds):
        shift = r % len(variants)
        for experiment in experiments:
            for variant in variants[shift:] + variants[:shift]:
                jobs.append(Job(experiment, variant, r, r % seeds))
    return jobs


def experiment_flags(args: CommBenchArgs, experiment: str, data_dir: Path) -> tuple[str, ...]:
    if experiment == "cifar10":
        return (
            *("--model", "small", "--data-dir", str(data_dir), "--no-verify"),
            *("--epochs", str(args.cifar_epochs), "--batch-size", str(CIFAR_BATCH), "--eval-batch-size", "250"),
        )
    return ("--steps", str(args.charlm_steps), "--warmup-steps", str(max(1, args.charlm_steps // 10)))


def command(args: CommBenchArgs, job: Job, run_dir: Path, data_dir: Path) -> list[str]:
    variant = VARIANTS[job.variant]
    if job.variant == "powersgd":
        variant = (*variant, "--powersgd-start-step", str(args.powersgd_start_step))
    return [
        sys.executable,
        *("-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={args.nproc}"),
        *("-m", "bench.comm_probe", f"experiments.{job.experiment}"),
        *("--run-dir", str(run_dir), "--seed", str(job.seed), "--backend", "gloo"),
        *experiment_flags(args, job.experiment, data_dir),
        *variant,
    ]


def run_job(cmd: list[str], log_path: Path, timeout: float) -> int | None:
    """The run's exit code, output into ``log_path``; None when it ran past ``timeout`` (then stopped)."""
    # A core per process: none competes with its own threads.
    code, timed_out = run_in_own_session(cmd, REPO, child_env(OMP_NUM_THREADS="1"), log_path, timeout)
    return None if timed_out else code


def read_result(job: Job, run_dir: Path) -> RunResult:
    metrics = json.loads((run_dir / layout.METRICS).read_text())
    probe = json.loads((run_dir / PROBE_FILE).read_text())["optimizer_bytes"]
    comm = metrics.get("comm_bytes_per_step")
    return RunResult(
        experiment=job.experiment,
        variant=job.variant,
        round=job.round,
        seed=job.seed,
        step_s=metrics["global_batch_size"] / metrics[THROUGHPUT[job.experiment]],
        comm_bytes=None if comm is None else float(comm),
        metric=float(metrics[METRICS[job.experiment]]),
        state_bytes=tuple(int(rank["state"]) for rank in probe),
    )


def write_standin(data_dir: Path, args: CommBenchArgs) -> None:
    from experiments import cifar10_data  # here: charlm alone needs none of it

    cifar10_data.write_standin(data_dir, train_images=args.cifar_images, test_images=CIFAR_TEST_IMAGES)


def describe(args: CommBenchArgs, experiments: list[str]) -> list[str]:
    rounds = args.round_count
    lines = [
        f"DDP's communication knobs against --comm-hook none: {args.nproc} processes per run "
        f"(ddp_core.torchrun --standalone), gloo on CPU, 1 thread each, torch {torch.__version__}",
    ]
    if "cifar10" in experiments:
        steps = args.cifar_images // (CIFAR_BATCH * args.nproc) * args.cifar_epochs
        lines.append(
            f"cifar10: small CNN, {args.cifar_images} generated stand-in images, {args.cifar_epochs} epoch(s) = "
            f"{steps} steps of {CIFAR_BATCH} images per process; eval on {CIFAR_TEST_IMAGES} generated test images"
        )
    if "charlm" in experiments:
        lines.append(f"charlm: default model and corpus, {args.charlm_steps} steps of 16 windows per process")
    lines += [
        f"powersgd: rank 1, plain all-reduce for the first {args.powersgd_start_step} steps (counted in the mean); "
        "zero: ZeroRedundancyOptimizer, plain fp32 all-reduce",
        f"{rounds} round(s), seeds {', '.join(str(s) for s in range(min(rounds, args.seeds)))}: each round runs "
        "every variant once, their order rotated; step time is rank 0's training time per step (no set-up, "
        "evaluation or checkpoint), its ratio taken against none of the same round",
        "all-reduced: metrics.json's comm_bytes_per_step (counted where the hook sends them); optimizer state: "
        "tensor bytes in each rank's optimizer state at the end, which is its peak (allocated at the first step)",
    ]
    return lines


def run(args: CommBenchArgs) -> str:
    experiments, variants = _names(args.experiments), _names(args.variants)
    jobs = schedule(experiments, variants, args.round_count, args.seeds)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-comm-"))
    work.mkdir(parents=True, exist_ok=True)
    if "cifar10" in experiments:
        write_standin(work / "data", args)
    results = []
    for number, job in enumerate(jobs, 1):
        run_dir, log = work / job.name, work / f"{job.name}.log"
        shutil.rmtree(run_dir, ignore_errors=True)  # a kept folder from an earlier bench: start this run afresh
        began = time.perf_counter()
        code = run_job(command(args, job, run_dir, work / "data"), log, args.timeout)
        if code != 0:
            what = f"ran past --timeout={args.timeout:g} s" if code is None else f"exited {code}"
            sys.exit(f"error: {job.name} {what}; its output: {log} (every run so far is kept in {work})")
        results.append(read_result(job, run_dir))
        took = time.perf_counter() - began
        print(f"[{number}/{len(jobs)}] {job.name} (seed {job.seed}): {took:.0f} s", file=sys.stderr, flush=True)
    if not args.keep:
        shutil.rmtree(work)
    rows = summarize(results)
    if args.json:
        return json.dumps({"about": describe(args, experiments), "rows": as_json(rows)}, indent=2)
    return markdown(
        rows, {name: METRICS[name].removeprefix("eval_") for name in experiments}, describe(args, experiments)
    )


def validate(args: CommBenchArgs) -> None:
    """What spans several options, checked before any run starts."""
    if "cifar10" in _names(args.experiments):
        least = CIFAR_BATCH * args.nproc
        require(
            args.cifar_images >= least,
            f"--cifar-images={args.cifar_images} is less than one step of {least} images ({CIFAR_BATCH} per process "
            f"x --nproc={args.nproc}): give at least that many",
        )


def run_bench(args: CommBenchArgs) -> None:
    validate(args)
    print("\n" + run(args), flush=True)


main = command_main(CommBenchArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
