"""What a study is made of: its combinations of the grid's values, one task per combination and seed, and the
state a task's run ended in. Every module of the study reads them; this one imports none of those."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_core.runs import read_run


@dataclass(frozen=True)
class Combination:
    values: tuple[tuple[str, str], ...]  # (flag name with dashes, value as given), in grid order

    @property
    def name(self) -> str:
        return ",".join(f"{flag}={value}" for flag, value in self.values) or "base"

    @property
    def folder(self) -> str:
        return "_".join(f"{flag}={value}".replace("/", "-") for flag, value in self.values) or "base"

    @property
    def argv(self) -> list[str]:
        return [item for flag, value in self.values for item in (f"--{flag}", value)]


@dataclass
class Task:
    combination: Combination
    seed: int
    run_dir: Path
    log: Path
    args: Any  # the run's parsed flags (the experiment's args dataclass)
    state: str = "new"  # new, finished, resume, diverged, failed

    @property
    def label(self) -> str:
        return f"{self.combination.name} seed {self.seed}"


@dataclass
class Study:
    experiment: str
    name: str
    dir: Path
    seeds: int
    grid: dict[str, list[str]]
    nproc: int
    flags: list[str]
    launcher: str
    metrics: list[str] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)

    @property
    def combinations(self) -> list[Combination]:
        keys = list(self.grid)
        return [Combination(tuple(zip(keys, values))) for values in itertools.product(*self.grid.values())]

    def plan(self) -> dict[str, Any]:
        return {"experiment": self.experiment, "grid": self.grid, "nproc": self.nproc, "flags": self.flags}

    def run_argv(self, task: Task) -> list[str]:
        return [*self.flags, *task.combination.argv, "--seed", str(task.seed), "--run-dir", str(task.run_dir)]


def state_after(task: Task, code: int) -> str:
    info = read_run(task.run_dir, task.run_dir.name)
    if code == 0 and info.metrics:
        return "finished"
    return info.status if info.status in ("diverged", "stopped") else "failed"
