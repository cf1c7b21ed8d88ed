"""What bench.recovery's two paths (bench/recovery.py, bench/recovery_heal.py) share: the options, a fault, a run,
what the timeline says of them, and how a figure is shown."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_core.config import option
from ddp_core.layout import METRICS


@dataclass
class RecoveryArgs:
    experiments: str = option("toy,cifar10", "comma-separated: toy, cifar10 (--model small, a generated stand-in)")
    nproc: int = option(3, "processes per run", minimum=2, maximum=16)
    every: float = option(20.0, "seconds of training between faults", above=0)
    faults: int = option(3, "faults per faulted run (0: one every --every seconds until the run ends)", minimum=0)
    repeats: int = option(2, "pairs of runs (faulted, fault-free) per experiment, alternating", minimum=1)
    toy_steps: int = option(3000, "the toy's optimizer steps per run", minimum=1)
    cifar10_epochs: int = option(3, "CIFAR10's epochs per run", minimum=1)
    cifar10_images: int = option(6000, "training images in CIFAR10's stand-in", minimum=256)
    checkpoint_every: int = option(20, "--checkpoint-every of every run", minimum=1)
    extra: str = option("", "more flags for every run, space-separated (e.g. --no-checkpoint-async)")
    cold: bool = option(False, "restarted workers start as new interpreters (DDP_LAB_FAST_RESTART=0), not forked")
    heal: bool = option(False, "torchrun --heal: only the killed worker is replaced (bench/recovery_heal.py)")
    seed: int = option(0, "the random choice of the killed worker", minimum=0)
    timeout: float = option(900.0, "seconds before a run counts as hung", above=0)
    json: bool = option(False, "print every figure as JSON instead of tables")


@dataclass
class Fault:
    kill: float
    rank: int
    step: int  # the step the killed rank had reached (its heartbeat)
    phases: dict[str, float] = field(default_factory=dict)  # seconds, by PHASES' name
    resumed_at: int | None = None  # the checkpoint's step
    steps_lost: int | None = None
    lost_s: float | None = None  # kill to the first step, plus the lost steps at the fault-free pace
    pid: int | None = None  # the killed worker's
    abandoned: int | None = None  # --heal: the steps the survivors abandoned (each retried with the replacement)


@dataclass
class Job:
    returncode: int | None
    wall_s: float
    train_s: float  # the first step of the first attempt to the launcher's exit
    faults: list[Fault]
    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)  # its timeline


def workers(events: list[dict[str, Any]], restart: int) -> tuple[dict[int, int], str | None]:
    """The pid of each rank of ``restart`` that took its first step (a worker forked from a warm parent has the
    parent's command line, so the timeline, not /proc, says which process is which rank), and the launcher's
    heartbeat folder."""
    pids = {e["rank"]: e["pid"] for e in events if e["event"] == "first_step" and e["restart"] == restart}
    job_dirs = [e.get("job_dir") for e in events if e["event"] == "spawned" and e["restart"] == restart]
    return pids, job_dirs[-1] if job_dirs else None


def training(events: list[dict[str, Any]], restart: int, nproc: int) -> float | None:
    """When every rank of ``restart`` had taken its first step (None: not yet; under --heal a replacement's first
    step comes later in the same restart, 0)."""
    times = [e["t"] for e in events if e["event"] == "first_step" and e["restart"] == restart]
    return times[nproc - 1] if len(times) >= nproc else None


def steps_of(job: Job) -> int:
    metrics = json.loads((job.run_dir / METRICS).read_text())
    return int(metrics.get("steps", 0))


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    values = [v for v in values if v is not None and v == v]
    if not values:
        return "-"
    middle = fmt.format(statistics.median(values))
    return middle if len(values) == 1 else f"{middle} [{fmt.format(min(values))}-{fmt.format(max(values))}]"
