"""bench.comm's arithmetic and its table: from each run's figures to one row per experiment and variant.

Pure functions of ``RunResult`` records (no training here), so that tests can hand them made-up figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

BASELINE = "none"  # the variant every other one is compared with: plain fp32 all-reduce, replicated optimizer


@dataclass(frozen=True)
class RunResult:
    """What one run's files say (metrics.json, and bench.comm_probe's file for the optimizer state)."""

    experiment: str
    variant: str
    round: int
    seed: int
    step_s: float  # rank 0's training time per optimizer step
    comm_bytes: float | None  # metrics.json's comm_bytes_per_step; None where this ddp_core does not write it
    metric: float  # the experiment's headline: eval_accuracy or eval_loss
    state_bytes: tuple[int, ...]  # each rank's optimizer state


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float


@dataclass(frozen=True)
class Row:
    experiment: str
    variant: str
    comm_bytes: float | None  # mean over the runs
    comm_ratio: float | None  # ÷ the baseline's
    step_ms: float  # median over the rounds
    step_ratio: Spread  # per round, ÷ the baseline's step time in the same round
    state_bytes: tuple[int, ...]  # per rank, the largest over the runs
    state_ratio: float  # the largest rank's ÷ the baseline's largest rank's
    metric_mean: float
    metric_sd: float | None  # over the seeds; None with one seed
    seeds: int


def spread(values: Sequence[float]) -> Spread:
    return Spread(statistics.median(values), min(values), max(values))


def per_seed_means(results: Sequence[RunResult]) -> list[float]:
    """One value per seed: a seed that ran in several rounds counts once (its runs' mean)."""
    by_seed: dict[int, list[float]] = {}
    for result in results:
        by_seed.setdefault(result.seed, []).append(result.metric)
    return [statistics.fmean(values) for _, values in sorted(by_seed.items())]


def summarize(results: Sequence[RunResult]) -> list[Row]:
    """One row per (experiment, variant) in the order first run; every variant's ratios against the baseline
    of its experiment. Each round must hold every variant of its experiment once."""
    groups: dict[tuple[str, str], dict[int, RunResult]] = {}
    for result in results:
        runs = groups.setdefault((result.experiment, result.variant), {})
        if result.round in runs:
            raise ValueError(f"{result.experiment} {result.variant}: round {result.round} twice")
        runs[result.round] = result
    rows = []
    for (experiment, variant), runs in groups.items():
        baseline = groups.get((experiment, BASELINE))
        if baseline is None or baseline.keys() != runs.keys():
            raise ValueError(f"{experiment} {variant}: every round needs a {BASELINE!r} run to compare with")
        ordered = [runs[r] for r in sorted(runs)]
        base = [baseline[r] for r in sorted(runs)]
        comm = _mean_or_none([run.comm_bytes for run in ordered])
        base_comm = _mean_or_none([run.comm_bytes for run in base])
        state = _peak_per_rank(ordered)
        base_state = max(_peak_per_rank(base))
        seeds = per_seed_means(ordered)
        rows.append(
            Row(
                experiment=experiment,
                variant=variant,
                comm_bytes=comm,
                comm_ratio=comm / base_comm if comm is not None and base_comm else None,
                step_ms=statistics.median(run.step_s for run in ordered) * 1e3,
                step_ratio=spread([run.step_s / b.step_s for run, b in zip(ordered, base)]),
                state_bytes=state,
                state_ratio=max(state) / base_state if base_state else math.nan,
                metric_mean=statistics.fmean(seeds),
                metric_sd=statistics.stdev(seeds) if len(seeds) > 1 else None,
                seeds=len(seeds),
            )
        )
    return rows


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.fmean(present) if present and len(present) == len(values) else None


def _peak_per_rank(runs: Sequence[RunResult]) -> tuple[int, ...]:
    return tuple(max(column) for column in zip(*(run.state_bytes for run in runs)))


def size(count: float) -> str:
    """Bytes in binary units, 3 significant figures and no exponent: ``1.84 MiB``, ``912 KiB``, ``1 MiB`` for
    a few bytes short of one (rounded to 3 figures, it is one), ``40 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        value = count / scale
        if value >= 0.9995:
            return f"{value:.0f} {unit}" if value >= 99.95 else f"{value:.3g} {unit}"
    return f"{count:.0f} B"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3g}×"


def _cells(row: Row, metric_name: str) -> list[str]:
    comm = "n/a" if row.comm_bytes is None else f"{size(row.comm_bytes)} ({_ratio(row.comm_ratio)})"
    step = row.step_ratio
    if row.variant == BASELINE:
        timing = f"1 ({row.step_ms:.1f} ms/step)"
    else:
        timing = f"{step.median:.2f}× ({step.low:.2f}–{step.high:.2f})"
    ranks = " / ".join(size(value) for value in row.state_bytes)
    if len(set(row.state_bytes)) == 1:
        ranks = f"{size(row.state_bytes[0])} each"
    state = f"{ranks} ({_ratio(row.state_ratio)})"
    sd = "n/a" if row.metric_sd is None else f"{row.metric_sd:.4f}"
    return [row.experiment, row.variant, comm, timing, state, f"{metric_name} {row.metric_mean:.4f} ± {sd}"]


def markdown(rows: Sequence[Row], metric_names: dict[str, str], about: Sequence[str]) -> str:
    """The comparison table, ``about`` (what was run, how it was measured) as the lines above it."""
    lines = [
        *about,
        "",
        "| experiment | variant | all-reduced per step per rank (÷ none) | step time ÷ none: median (min–max) "
        "| optimizer state per rank (largest ÷ none) | final eval, mean ± sd over seeds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += ["| " + " | ".join(_cells(row, metric_names[row.experiment])) + " |" for row in rows]
    return "\n".join(lines)


def as_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]
