"""A study: every combination of a grid of flags, each run for the same seeds 0..N-1, and the noise measured
(docs/studies.md). ``python -m tools.study toy --seeds 3 --grid lr=0.05,0.2 -- --steps 150``

Each run is an ordinary run in ``runs/studies/NAME/COMBINATION/seed-S``, here, under Slurm or Kubernetes. Started
again, a study skips finished runs and resumes stopped ones; a changed plan or run config is refused (exit 2)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

from ddp_core.config import config_changes, parse_args
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.output.checkpoint import CheckpointDir
from ddp_core.runs import default_outcome, read_run
from tools.study.grid import Combination as Combination  # the study's parts, read by its users from here too
from tools.study.grid import Study, Task

PLAN_FILE = "plan.json"
OWN_FLAGS = ("--seed", "--run-dir", "--resume", "--resume-from")  # the study sets them for every run


def _parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    grid: dict[str, list[str]] = {}
    for item in items:
        flag, sep, values = item.partition("=")
        flag = flag.strip().lstrip("-").replace("_", "-")
        choices = [value.strip() for value in values.split(",") if value.strip()]
        if not sep or not flag or not choices:
            raise ConfigError(f"--grid {item}: write FLAG=V1,V2 (e.g. --grid lr=0.05,0.2)")
        if flag in grid:
            raise ConfigError(f"--grid {flag} is given twice: list its values once, FLAG=V1,V2")
        if len(set(choices)) != len(choices):
            raise ConfigError(f"--grid {item}: a value is listed twice")
        if f"--{flag}" in OWN_FLAGS:
            raise ConfigError(f"--grid {flag}: the study sets --seed, --run-dir and --resume itself (--seeds N)")
        grid[flag] = choices
    return grid


def _experiment_main(experiment: str) -> Any:
    try:
        module = importlib.import_module(f"experiments.{experiment}")
    except ModuleNotFoundError as error:
        if error.name in (f"experiments.{experiment}", "experiments"):
            raise ConfigError(
                f"no experiment {experiment}: python -m experiments lists them (experiments/{experiment}.py)"
            ) from None
        raise
    main = getattr(module, "main", None)
    if main is None or not hasattr(main, "args_type"):
        raise ConfigError(f"experiments.{experiment} is not a training experiment (no experiment_main)")
    return main


def _check_flags(flags: list[str], grid: dict[str, list[str]]) -> None:
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name in OWN_FLAGS:
            raise ConfigError(f"{name} after --: the study sets --seed, --run-dir and --resume for every run itself")
        if name.startswith("--") and name[2:].replace("_", "-") in grid:
            raise ConfigError(f"{name} is both in --grid and after --: give it in one place")


def _check_plan(study: Study) -> None:
    """The same study as before, or one line saying what changed (seeds may be added or dropped)."""
    path = study.dir / PLAN_FILE
    if not path.is_file():
        return
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} cannot be read ({error}): move it away or choose another --name") from None
    now = study.plan()
    for key, what in (("experiment", "experiment"), ("grid", "--grid"), ("nproc", "--nproc")):
        if before.get(key) != now[key]:
            raise ConfigError(
                f"study {study.name} was started with {what} {_show(before.get(key))}, this command has "
                f"{_show(now[key])}: rerun its command, or choose another --name"
            )


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{key}={','.join(values)}" for key, values in value.items()) or "(none)"
    return str(value)


def _state(task: Task, study: Study) -> str:
    """What is on disk for this run; a run made with other computing values is refused (the runs' own rule)."""
    info = read_run(task.run_dir, task.run_dir.name)
    if info.manifest:
        changes = config_changes(info.config, task.args)
        world = info.world_size
        if world is not None and world != study.nproc:
            changes.append(f"processes: {world} -> {study.nproc}")
        if changes:
            raise ConfigError(
                f"study {study.name}: {task.run_dir} was run with other values ({', '.join(changes)}; run -> this "
                "command): rerun the study's command, or choose another --name"
            )
    if info.status == "running":
        raise ConfigError(f"{task.run_dir} is running (another study or launch of it): wait for it to end")
    if info.status == "finished" and info.metrics:
        return "finished"
    if info.status == "diverged":
        return "diverged"
    if CheckpointDir.of_run(task.run_dir).exists():
        return "resume"
    return "new"


def build(ns: argparse.Namespace, flags: list[str]) -> Study:
    grid = _parse_grid(ns.grid)
    _check_flags(flags, grid)
    if ns.seeds < 1:
        raise ConfigError(f"--seeds {ns.seeds}: run at least 1 seed (3 or more to measure the noise)")
    if ns.nproc is None:
        from ddp_core.process.nproc import processes_per_node

        nproc = processes_per_node(os.environ, Path.cwd() / ".env")
    else:
        nproc = ns.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: at least 1 process per run")
    name = ns.name or "-".join([ns.experiment, *grid]) or ns.experiment
    if "/" in name or name in ("", ".", ".."):
        raise ConfigError(f"--name {name!r}: a folder name, without /")
    study = Study(
        experiment=ns.experiment,
        name=name,
        dir=Path(ns.runs_dir) / "studies" / name,
        seeds=ns.seeds,
        grid=grid,
        nproc=nproc,
        flags=flags,
        launcher=ns.launcher,
        metrics=list(ns.metric or []),
    )
    if study.launcher == "slurm":  # the runs get what the batch script exports: parse their flags with it
        from tools.study.slurm import script_defaults

        for variable, value in script_defaults(ns.sbatch_script).items():
            os.environ.setdefault(variable, value)
    main = _experiment_main(ns.experiment)
    _check_plan(study)
    for combination in study.combinations:
        for seed in range(study.seeds):
            run_dir = study.dir / combination.folder / f"seed-{seed}"
            task = Task(combination, seed, run_dir, study.dir / "logs" / f"{combination.folder}.seed-{seed}.log", None)
            task.args = parse_args(main.args_type, study.run_argv(task), description=main.description)
            main.check(task.args)  # the experiment's own checks, before anything runs
            task.state = _state(task, study)
            study.tasks.append(task)
    return study


def _write_plan(study: Study) -> None:
    study.dir.mkdir(parents=True, exist_ok=True)
    (study.dir / "logs").mkdir(exist_ok=True)
    path = study.dir / PLAN_FILE
    if not path.exists():
        path.write_text(json.dumps(study.plan(), indent=2) + "\n")


def launch_command(study: Study, task: Task) -> list[str]:
    """One run through the project's launcher; --resume where its directory holds a checkpoint."""
    return [
        sys.executable,
        "-m",
        "ddp_core.torchrun",
        "--standalone",
        f"--nproc-per-node={study.nproc}",
        "-m",
        f"experiments.{study.experiment}",
        *study.run_argv(task),
        *(["--resume"] if task.state == "resume" else []),
    ]


def argument_parser() -> argparse.ArgumentParser:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ConfigError(message)

    parser = Parser(
        prog="python -m tools.study",
        description="Every combination of a grid, for the same seeds 0..N-1, and its statistics. "
        "Flags after -- go to every run.",
    )
    parser.add_argument("experiment", metavar="EXPERIMENT", help="an experiment of experiments/ (e.g. toy)")
    parser.add_argument("--seeds", type=int, required=True, help="seeds 0..N-1 for every combination")
    parser.add_argument(
        "--grid", action="append", default=[], metavar="FLAG=V1,V2", help="a flag and its values (repeatable)"
    )
    parser.add_argument("--nproc", type=int, help="processes per run (default: NPROC, else every GPU or 2)")
    parser.add_argument("--name", help="the study's folder under RUNS_DIR/studies (default: EXPERIMENT-FLAG...)")
    parser.add_argument("--launcher", choices=("local", "slurm", "k8s"), default="local", help="where the runs run")
    parser.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="at most N runs at once (default: local 1, one after another; slurm and k8s: all)",
    )
    parser.add_argument(
        "--gpus-per-run",
        type=int,
        metavar="G",
        help="GPUs of each run, its own (CUDA_VISIBLE_DEVICES; k8s: the pod's limit); 0: CPU (default: --nproc "
        "where there are GPUs, else 0)",
    )
    parser.add_argument("--runs-dir", default="runs", help="the folder holding runs (default: runs)")
    parser.add_argument(
        "--metric",
        action="append",
        help="a metric of metrics.json to compare (default: the experiment's first headline metric; a throughput "
        "such as samples_per_s only when named here)",
    )
    parser.add_argument(
        "--sbatch-script", default="docker/slurm.sbatch", help="--launcher slurm: the batch script of each task"
    )
    parser.add_argument(
        "--sbatch", action="append", default=[], metavar="OPTION", help="--launcher slurm: an option for sbatch"
    )
    parser.add_argument("--apply", action="store_true", help="--launcher k8s: kubectl apply the Job and wait for it")
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


@exits_with_one_line
def main(argv: Sequence[str] | None = None) -> int:
    own, flags = split_argv(sys.argv[1:] if argv is None else argv)
    ns = argument_parser().parse_args(own)
    if ns.parallel is not None and ns.parallel < 1:
        raise ConfigError(f"--parallel {ns.parallel}: at least 1 run at a time (1: one after another)")
    if ns.apply and ns.launcher != "k8s":
        raise ConfigError("--apply is for --launcher k8s (it applies the Job it writes)")
    if ns.gpus_per_run is not None and ns.launcher == "slurm":
        raise ConfigError("--gpus-per-run: under --launcher slurm the batch script asks for GPUs (--sbatch=--gpus=G)")
    study = build(ns, flags)
    resources: list[dict[str, str]] = []
    if study.launcher == "local":  # refused before anything is written or runs
        from tools.study.local import slots

        resources = slots(ns.parallel or 1, study.nproc, ns.gpus_per_run, os.environ)
    _write_plan(study)
    todo = [task for task in study.tasks if task.state in ("new", "resume")]
    if not todo:
        print(f"study {study.name}: all {len(study.tasks)} runs are done; nothing to run", file=sys.stderr)
        endings = []
    elif study.launcher == "slurm":
        from tools.study.slurm import run_slurm

        endings = run_slurm(study, todo, ns.sbatch_script, ns.sbatch, ns.parallel)
    elif study.launcher == "k8s":
        from tools.study.k8s import run_k8s

        applied = run_k8s(study, todo, ns.parallel, ns.gpus_per_run, ns.apply)
        if applied is None and not any(task.state == "finished" for task in study.tasks):
            return 0  # written, not applied: the same command reports once the Job has run
        endings = applied or []
    else:
        from tools.study.local import run_local

        endings = run_local(study, todo, resources, launch_command)
    from tools.study.local import Ending, last_line
    from tools.study.report import report

    metrics = study.metrics or _default_metrics(study)
    print(report(study, metrics))
    ran = {ending.label for ending in endings}
    earlier = [  # diverged in an earlier start: still left out of the statistics, still said why
        Ending(task.label, "diverged in an earlier start", None, last_line(task.log), task.log)
        for task in study.tasks
        if task.state == "diverged" and task.label not in ran
    ]
    failed = [ending for ending in endings if not ending.state.startswith("diverged")]
    diverged = [ending for ending in [*endings, *earlier] if ending.state.startswith("diverged")]
    if diverged:
        print(
            f"\n{len(diverged)} run(s) diverged, left out of the statistics:\n  "
            + "\n  ".join(e.line() for e in diverged),
            file=sys.stderr,
        )
    if failed:
        print(f"\n{len(failed)} run(s) did not finish:\n  " + "\n  ".join(e.line() for e in failed), file=sys.stderr)
        return 1
    return 0


def _default_metrics(study: Study) -> list[str]:
    """The experiment's first headline metric (its manifest's), read from the first run that wrote metrics."""
    for task in study.tasks:
        info = read_run(task.run_dir, task.run_dir.name)
        if info.metrics:
            outcome = default_outcome(info)
            return [outcome] if outcome else []
    return []
