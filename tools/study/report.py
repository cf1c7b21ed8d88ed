"""A study's results: ``study.json``, the table, ``study.png`` and TensorBoard's HParams for every run, from the
runs' own ``metrics.json`` files, read again each time."""

from __future__ import annotations

import json
import math
from itertools import combinations as pairs
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_core.runs import is_number, read_run, show, text_table
from tools.study import stats

if TYPE_CHECKING:
    from tools.study.grid import Study

HPARAMS_SUFFIX = ".study-hparams"  # the events file this writes into a run directory, once


def results(study: Study, metrics: list[str]) -> dict[str, Any]:
    runs, by_combination = [], {}
    for task in study.tasks:
        info = read_run(task.run_dir, task.run_dir.name)
        values = {m: info.metrics[m] for m in metrics if is_number(info.metrics.get(m))}
        finished = info.status == "finished" and bool(info.metrics)
        runs.append(
            {
                "combination": task.combination.name,
                "values": dict(task.combination.values),
                "seed": task.seed,
                "run_dir": task.run_dir.relative_to(study.dir).as_posix(),
                "status": info.status if info.manifest else "not started",
                "metrics": values if finished else {},
            }
        )
        if finished:
            by_combination.setdefault(task.combination.name, {})[task.seed] = values
    combos = []
    for combination in study.combinations:
        seeds = by_combination.get(combination.name, {})
        summary = {}
        for metric in metrics:
            per_seed = {seed: values[metric] for seed, values in sorted(seeds.items()) if metric in values}
            if per_seed:
                summary[metric] = {**stats.summarize(list(per_seed.values())).to_json(), "per_seed": per_seed}
        combos.append({"name": combination.name, "values": dict(combination.values), "metrics": summary})
    comparisons = []
    for a, b in pairs([combination.name for combination in study.combinations], 2):
        for metric in metrics:
            seeds_a, seeds_b = by_combination.get(a, {}), by_combination.get(b, {})
            common = sorted(s for s in set(seeds_a) & set(seeds_b) if metric in seeds_a[s] and metric in seeds_b[s])
            if common:
                paired = [(seeds_a[s][metric], seeds_b[s][metric]) for s in common]
                comparisons.append({**stats.compare(a, b, metric, paired).to_json(), "seeds": common})
    return {
        "study": study.name,
        "experiment": study.experiment,
        "plan": {**study.plan(), "seeds": list(range(study.seeds))},
        "metrics": metrics,
        "method": stats.METHOD,
        "runs": runs,
        "combinations": combos,
        "comparisons": comparisons,
    }


def _interval(ci: list[float] | None) -> str:
    return f"[{show(float(ci[0]))}, {show(float(ci[1]))}]" if ci else "-"


def table(data: dict[str, Any]) -> str:
    rows = [
        (combo["name"], metric, str(s["n"]), show(s["mean"]), show(s["sd"]), _interval(s["ci95"]))
        for combo in data["combinations"]
        for metric, s in combo["metrics"].items()
    ]
    out = [text_table(("combination", "metric", "n", "mean", "sd", "95% CI"), rows) if rows else "no results"]
    if data["comparisons"]:
        rows = [
            (
                f"{c['b']} - {c['a']}",
                c["metric"],
                str(c["n"]),
                show(c["mean_difference"]),
                _interval(c["ci95"]),
                c["verdict"],
                "-" if c["seeds_needed"] is None else str(c["seeds_needed"]),
            )
            for c in data["comparisons"]
        ]
        header = ("paired difference", "metric", "n", "mean", "95% CI", "verdict", "seeds needed")
        out += ["", text_table(header, rows)]
    out += [
        "",
        f"95% CI: Student's t below {stats.BOOTSTRAP_FROM} seeds, an expanded percentile bootstrap from "
        f"{stats.BOOTSTRAP_FROM} (study.json's method)",
    ]
    return "\n".join(out)


def draw(data: dict[str, Any], path: Path) -> None:
    """One panel per metric: each combination's value per seed (dots) and its mean with the interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = data["metrics"] or ["(none)"]
    names = [combo["name"] for combo in data["combinations"]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(max(4.0, 1.2 * len(names) + 2) * len(metrics), 4), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        for x, combo in enumerate(data["combinations"]):
            s = combo["metrics"].get(metric)
            if not s:
                continue
            seeds = list(s["per_seed"].values())
            offsets = (
                [x - 0.15 + 0.3 * i / max(1, len(seeds) - 1) for i in range(len(seeds))] if len(seeds) > 1 else [x]
            )
            axis.scatter(offsets, seeds, s=18, color="tab:blue", alpha=0.7, zorder=2)
            if s["ci95"]:
                low, high = s["ci95"]
                yerr = [[s["mean"] - low], [high - s["mean"]]]
                axis.errorbar(x + 0.3, s["mean"], yerr=yerr, fmt="o", color="black", capsize=4, zorder=3)
            else:
                axis.plot(x + 0.3, s["mean"], "o", color="black", zorder=3)
        axis.set_xticks(range(len(names)), names, rotation=20 if len(names) > 3 else 0)
        axis.set_title(metric)
        axis.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{data['study']}: each seed (blue), mean and 95% interval (black)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_hparams(study: Study, data: dict[str, Any]) -> int:
    """TensorBoard's HParams for every finished run, in its own directory (beside its curves), once."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    domains = {flag: list(values) for flag, values in study.grid.items()}
    written = 0
    for task, run in zip(study.tasks, data["runs"]):
        if not run["metrics"] or any(task.run_dir.glob(f"*{HPARAMS_SUFFIX}")):
            continue
        values: dict[str, Any] = {flag: value for flag, value in task.combination.values}
        values["seed"] = task.seed
        metric_values = {
            f"study/{name}": float(value) for name, value in run["metrics"].items() if math.isfinite(value)
        }
        experiment, start, end = hparams(values, metric_values, hparam_domain_discrete={**domains})
        with SummaryWriter(log_dir=str(task.run_dir), filename_suffix=HPARAMS_SUFFIX) as writer:
            for summary in (experiment, start, end):
                writer.file_writer.add_summary(summary)
            for name, value in metric_values.items():
                writer.add_scalar(name, value)
        written += 1
    return written


def report(study: Study, metrics: list[str]) -> str:
    data = results(study, metrics)
    (study.dir / "study.json").write_text(json.dumps(data, indent=2) + "\n")
    if any(combo["metrics"] for combo in data["combinations"]):
        draw(data, study.dir / "study.png")
        write_hparams(study, data)
    return f"study {study.name}: {study.dir}/study.json, study.png\n\n{table(data)}"
