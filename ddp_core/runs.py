"""Every run at a glance: ``python -m ddp_core.runs [RUNS_DIR]`` (default ``runs``), or ``make runs``.

One row per run, newest first, the experiment's headline metrics first; ``--compare RUN RUN`` lists what differs
and the equal metrics, ``--json`` prints the same as JSON. It reads only what the runs wrote (manifest.json,
metrics.json, the names in checkpoints/), never imports torch and trusts no absolute path. ``--same RUN RUN``
alone loads checkpoints (with torch): are the two runs' last states bitwise equal (``output/checkpoint_diff.py``)?
docs/configuration.md ("Every run at a glance") says what each column and status means.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn, Sequence

from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.exit_codes import STATUS_OF_EXIT_CODE
from ddp_core.layout import CHECKPOINTS, MANIFEST, METRICS, STAMP, STEP_FILE
from ddp_core.output.process_identity import alive_here

STATUSES = ("finished", "stopped", "failed", "diverged", "running", "incomplete")
# The metrics worth a glance after the experiment's own (its manifest's "headline"), in this order; an experiment
# with none of them shows its first numeric keys.
HEADLINE = ("final_loss", "eval_accuracy", "eval_loss", "images_per_s", "samples_per_s", "peak_gpu_memory_gib")
THROUGHPUT_SUFFIX = "_per_s"  # samples_per_s, images_per_s: a speed, never a study's outcome unless asked for
NOT_HEADLINE = frozenset(
    {"steps", "wall_time_s", "world_size", "global_batch_size", "seed", "warmup", "iters", "slowest_rank"}
)
MAX_HEADLINE = 3


@dataclass
class RunInfo:
    name: str  # the run directory relative to RUNS_DIR (its path where it is elsewhere)
    experiment: str | None = None
    started: datetime | None = None
    status: str = "incomplete"
    world_size: int | None = None
    nodes: int | None = None
    backend: str | None = None
    seed: Any = None
    commit: str | None = None
    dirty: bool | None = None
    step: int | None = None
    wall_time_s: float | None = None
    launches: int = 0  # how many times it was started (1 + resumes); 0 without a manifest
    headline: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)
    problems: list[str] = field(default_factory=list)  # unreadable files

    @property
    def code(self) -> str:
        return self.commit[:7] + ("-dirty" if self.dirty else "") if self.commit else "-"

    @property
    def world(self) -> str:
        if self.world_size is None:
            return "-"
        text = f"{self.world_size} {self.backend or '?'}"
        return text + (f" ({self.nodes} nodes)" if self.nodes and self.nodes > 1 else "")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["started"] = self.started.isoformat() if self.started else None
        data["code"] = None if self.code == "-" else self.code
        for bulky in ("config", "metrics", "manifest"):
            data.pop(bulky)
        return data


def _read_json(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        problems.append(f"{path.name}: {getattr(error, 'strerror', None) or error}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return data


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _time_from_name(name: str) -> datetime | None:
    try:
        return datetime.strptime(name.split("-", 1)[0], STAMP).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def newest_step(run_dir: Path) -> int | None:
    """The step of the newest ``checkpoints/step_XXXXXXXX.pt``, from its name alone."""
    try:
        names = [entry.name for entry in (run_dir / CHECKPOINTS).iterdir()]
    except OSError:
        return None
    steps = [int(match.group(1)) for match in map(STEP_FILE.fullmatch, names) if match]
    return max(steps) if steps else None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def headline_metrics(metrics: dict[str, Any], declared: Sequence[str] = ()) -> dict[str, Any]:
    """A few metrics to show: the experiment's ``declared`` ones, then those of ``HEADLINE`` present, else the
    first numeric top-level keys."""
    chosen = {key: metrics[key] for key in [*declared, *HEADLINE] if is_number(metrics.get(key))}
    if not chosen:
        chosen = {key: value for key, value in sorted(metrics.items()) if is_number(value) and key not in NOT_HEADLINE}
    return dict(list(chosen.items())[: max(MAX_HEADLINE, len(declared))])


def default_outcome(info: RunInfo) -> str | None:
    """A study's outcome when none is asked for: the first headline metric that is not a throughput."""
    outcomes = [key for key in info.headline if not key.endswith(THROUGHPUT_SUFFIX)]
    return outcomes[0] if outcomes else None


def _status(manifest: dict[str, Any], metrics: dict[str, Any] | None) -> str:
    recorded = manifest.get("status")
    if recorded in STATUSES:
        return recorded
    code = manifest.get("exit_code")
    if is_number(code):
        if int(code) == 0 and metrics is None:
            return "stopped"  # --stop-at-step: its checkpoint written, no metrics.json until the run ends
        return STATUS_OF_EXIT_CODE.get(int(code), "failed")
    alive = alive_here(manifest.get("rank0_process"))
    if alive is not None:
        return "running" if alive else "failed"
    if metrics is None:
        return "incomplete"
    return "stopped" if metrics.get("stopped_early") is True else "finished"


def read_run(run_dir: Path, name: str) -> RunInfo:
    """What ``run_dir``'s files say; never raises for a missing or broken file."""
    info = RunInfo(name=name)
    manifest = _read_json(run_dir / MANIFEST, info.problems) or {}
    metrics = _read_json(run_dir / METRICS, info.problems)
    info.manifest, info.metrics = manifest, metrics or {}
    history = manifest.get("history") if isinstance(manifest.get("history"), list) else []
    first = history[0] if history and isinstance(history[0], dict) else manifest  # a resumed run: its first launch
    info.launches = len(history) + 1 if manifest else 0
    info.experiment = manifest.get("experiment") if isinstance(manifest.get("experiment"), str) else None
    if info.experiment is None and run_dir.parent.name:
        info.experiment = run_dir.parent.name  # runs/<experiment>/<run>
    info.started = _time(first.get("start_time")) or _time(manifest.get("start_time")) or _time_from_name(run_dir.name)
    world = manifest.get("world") if isinstance(manifest.get("world"), dict) else {}
    info.world_size = world.get("world_size") if is_number(world.get("world_size")) else None
    if info.world_size is None and is_number(info.metrics.get("world_size")):
        info.world_size = info.metrics["world_size"]
    info.nodes = world.get("nodes") if is_number(world.get("nodes")) else None
    info.backend = world.get("backend") if isinstance(world.get("backend"), str) else None
    info.seed = manifest.get("seed")
    git = manifest.get("git") if isinstance(manifest.get("git"), dict) else {}
    info.commit = git.get("commit") if isinstance(git.get("commit"), str) else None
    info.dirty = git.get("dirty") if isinstance(git.get("dirty"), bool) else None
    info.config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    info.status = _status(manifest, metrics)
    step = info.metrics.get("steps")
    info.step = int(step) if is_number(step) else newest_step(run_dir)
    wall = info.metrics.get("wall_time_s")
    info.wall_time_s = float(wall) if is_number(wall) else None
    declared = manifest.get("headline") if isinstance(manifest.get("headline"), list) else []  # experiment_main's
    info.headline = headline_metrics(info.metrics, [name for name in declared if isinstance(name, str)])
    return info


def find_runs(runs_dir: Path) -> list[RunInfo]:
    """Every run directory (one holding manifest.json or metrics.json) under ``runs_dir``, newest first."""
    folders = {path.parent for pattern in (MANIFEST, METRICS) for path in runs_dir.rglob(pattern) if path.is_file()}
    names = {folder: folder.relative_to(runs_dir).as_posix() if folder != runs_dir else "." for folder in folders}
    runs = [read_run(folder, name) for folder, name in names.items()]
    oldest = datetime.min.replace(tzinfo=timezone.utc)
    runs.sort(key=lambda run: run.name)
    runs.sort(key=lambda run: run.started or oldest, reverse=True)  # undated runs last
    return runs


def show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.3g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def slowest_rank(metrics: dict[str, Any]) -> str:
    """``2 (1.91x)``: the rank that computed longest and its ratio to the median rank's; ``-`` for a world of one."""
    rank, ratio = metrics.get("slowest_rank"), metrics.get("slowest_rank_ratio")
    if not is_number(rank) or not is_number(metrics.get("world_size")) or metrics["world_size"] < 2:
        return "-"
    return f"{rank} ({ratio:.2f}x)" if is_number(ratio) else str(rank)


def text_table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


COLUMNS = ("run", "experiment", "started (UTC)", *"status world seed code step wall slowest metrics".split())


def table(runs: list[RunInfo]) -> str:
    rows = []
    for run in runs:
        status = run.status + (f" ({run.launches} launches)" if run.launches > 1 else "")
        rows.append(
            (
                run.name,
                run.experiment or "-",
                run.started.strftime("%Y-%m-%d %H:%M:%S") if run.started else "-",
                status,
                run.world,
                show(run.seed),
                run.code,
                show(run.step),
                _duration(run.wall_time_s),
                slowest_rank(run.metrics),
                " ".join(f"{key}={show(value)}" for key, value in run.headline.items()) or "-",
            )
        )
    return text_table(COLUMNS, rows)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


_MISSING = object()


def _differences(a: dict[str, Any], b: dict[str, Any], *, equal_too: bool = False) -> list[tuple[str, Any, Any]]:
    return [
        (key, a.get(key, _MISSING), b.get(key, _MISSING))
        for key in sorted(set(a) | set(b))
        if equal_too or a.get(key, _MISSING) != b.get(key, _MISSING)
    ]


def _change(a: Any, b: Any) -> str:
    if a == b and a is not _MISSING:
        return "same"
    if not (is_number(a) and is_number(b)):
        return ""
    return f"{b - a:+.4g}" if a == 0 else f"{(b - a) / abs(a) * 100:+.1f}%"


def _setup(run: RunInfo) -> dict[str, Any]:
    setup = dict(experiment=run.experiment, status=run.status, seed=run.seed, world=run.world, code=run.code)
    setup["gpus"] = run.manifest.get("gpus")
    return setup | {f"versions.{k}": v for k, v in (run.manifest.get("versions") or {}).items()}


def compare(a: RunInfo, b: RunInfo) -> str:
    """The configuration and setup that differ between ``a`` and ``b``, and every metric, equal or not."""

    def cell(value: Any) -> str:
        return "(absent)" if value is _MISSING else show(value)

    config = _differences(_flatten(a.config), _flatten(b.config))
    config = [row for row in config if row[0] != "run_dir"]  # always differs; the names head the columns
    metrics = _differences(_flatten(a.metrics), _flatten(b.metrics), equal_too=True)
    out = [f"A: {a.name}", f"B: {b.name}", ""]
    for title, rows in (("setup", _differences(_setup(a), _setup(b))), ("config", config)):
        if rows:
            out.append(text_table((title, "A", "B"), [(f"  {key}", cell(x), cell(y)) for key, x, y in rows]))
        else:
            out.append(f"{title}: the same")
        out.append("")
    if a.metrics or b.metrics:
        out.append(
            text_table(
                ("metrics", "A", "B", "B vs A"),
                [(f"  {key}", cell(x), cell(y), _change(x, y)) for key, x, y in metrics],
            )
        )
    else:
        out.append("metrics: neither run wrote metrics.json")
    return "\n".join(out)


def resolve_run(text: str, runs_dir: Path, flag: str = "--compare") -> tuple[Path, str]:
    """A run directory path, or a name relative to ``runs_dir``; ConfigError where neither is a run."""
    for candidate in (Path(text), runs_dir / text):
        if candidate.is_dir() and ((candidate / MANIFEST).is_file() or (candidate / METRICS).is_file()):
            try:
                name = candidate.resolve().relative_to(runs_dir.resolve()).as_posix()
            except (ValueError, OSError):
                name = text
            return candidate, name
    if Path(text).is_dir() or (runs_dir / text).is_dir():
        raise ConfigError(f"{flag} {text}: not a run directory (no manifest.json or metrics.json in it)")
    raise ConfigError(f"{flag} {text}: no such run (neither a directory nor a name under {runs_dir})")


def argument_parser() -> argparse.ArgumentParser:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:  # one line, exit 2, as every ddp-lab command
            raise ConfigError(message)

    parser = Parser(prog="python -m ddp_core.runs", description="Every run at a glance, newest first.")
    parser.add_argument(
        "runs_dir", nargs="?", default="runs", metavar="RUNS_DIR", help="the folder holding the runs (default: runs)"
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar="RUN",
        help="the config and metrics that differ between two runs (a run directory, or its name relative to RUNS_DIR)",
    )
    parser.add_argument(
        "--same",
        nargs=2,
        metavar="RUN",
        help="whether two runs' last checkpoints are bitwise equal, state by state: exit 0 if so, 1 naming the first "
        "state and tensor that differ",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


@exits_with_one_line
def main(argv: Sequence[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    runs_dir = Path(args.runs_dir)
    if args.compare and args.same:
        raise ConfigError("--compare and --same: one at a time")
    if args.same:
        (path_a, name_a), (path_b, name_b) = (resolve_run(text, runs_dir, "--same") for text in args.same)
        from ddp_core.output.checkpoint_diff import same_states  # torch: only here

        same, lines = same_states(path_a, path_b, (name_a, name_b))
        print("\n".join(lines))
        return 0 if same else 1
    if args.compare:
        (path_a, name_a), (path_b, name_b) = (resolve_run(text, runs_dir) for text in args.compare)
        a, b = read_run(path_a, name_a), read_run(path_b, name_b)
        if args.json:
            both = {"a": a.to_json(), "b": b.to_json()}
            for part in ("config", "metrics"):
                rows = _differences(_flatten(getattr(a, part)), _flatten(getattr(b, part)))
                both[part] = [{"key": k, "a": x, "b": y} for k, x, y in rows]
            flat_a, flat_b = _flatten(a.metrics), _flatten(b.metrics)
            both["metrics_same"] = sorted(k for k in flat_a if k and k in flat_b and flat_a[k] == flat_b[k])
            print(json.dumps(both, indent=2, default=lambda value: None if value is _MISSING else str(value)))
        else:
            print(compare(a, b))
        return 0
    if not runs_dir.is_dir():
        raise ConfigError(
            f"runs directory {runs_dir} {'is not a directory' if runs_dir.exists() else 'does not exist'}: "
            "pass the folder that holds the runs (python -m ddp_core.runs RUNS_DIR)"
        )
    runs = find_runs(runs_dir)
    if args.json:
        print(json.dumps([run.to_json() for run in runs], indent=2, default=str))
    elif not runs:
        print(f"no runs under {runs_dir}")
    else:
        print(table(runs))
        unreadable = [f"{run.name}: {'; '.join(run.problems)}" for run in runs if run.problems]
        if unreadable:
            print("\nunreadable files (their columns show -):\n  " + "\n  ".join(unreadable))
    return 0


if __name__ == "__main__":
    sys.exit(main())
