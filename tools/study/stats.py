"""The statistics of a study, numpy only and reproducible to the last digit: 95% intervals of the mean (Student's t,
or from ``BOOTSTRAP_FROM`` seeds the expanded percentile bootstrap), paired differences B - A, and the seeds
needed (paired t test, 80% power, Guenther's correction). References and coverage: docs/studies.md."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_FROM = 10
EXACT_UP_TO = 6  # 6**6 = 46,656 resamples at most
RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
ALPHA = 0.05
POWER = 0.80
LOWER_IS_BETTER = ("loss", "error", "perplexity", "time", "memory", "seconds")
HIGHER_IS_BETTER = ("accuracy", "per_s", "throughput", "f1", "score")

METHOD = {
    "interval": (
        f"{CONFIDENCE:.0%} interval of the mean over seeds: Student's t below {BOOTSTRAP_FROM} seeds; from "
        f"{BOOTSTRAP_FROM}, the expanded percentile bootstrap (Hesterberg 2015: percentiles at "
        "2 Phi(-sqrt(n/(n-1)) t_{0.975,n-1})), exact (all n**n resamples) for n <= "
        f"{EXACT_UP_TO}, else {RESAMPLES} resamples with numpy.random.default_rng({BOOTSTRAP_SEED}); "
        "percentiles: numpy's inverted_cdf"
    ),
    "difference": "paired over seeds: B - A for each seed both ran, its mean and the same bootstrap interval",
    "verdict": "the difference's interval excludes 0: better or worse (by the metric's direction); else not "
    "distinguishable at this n",
    "seeds_needed": (
        f"paired t test at {POWER:.0%} power, two-sided alpha {ALPHA}: n = (z_0.975 + z_0.80)^2 (sd_d / mean_d)^2 "
        "+ z_0.975^2 / 2, rounded up, at least 2 (normal approximation with Guenther's 1981 correction)"
    ),
}


def bootstrap_means(values: Sequence[float]) -> np.ndarray:
    """The means of the bootstrap resamples of ``values``: all n**n of them for small n, else RESAMPLES."""
    data = np.asarray(values, dtype=np.float64)
    n = len(data)
    if n == 0:
        raise ValueError("no values to resample")
    if n <= EXACT_UP_TO:
        indices = np.indices((n,) * n).reshape(n, -1).T  # every resample, each once
    else:
        indices = np.random.default_rng(BOOTSTRAP_SEED).integers(0, n, size=(RESAMPLES, n))
    return data[indices].mean(axis=1)


def t_quantile(probability: float, df: int) -> float:
    """Student's t quantile for ``probability`` > 0.5 with ``df`` degrees of freedom, by bisection on the
    exact CDF for an integer df (Abramowitz and Stegun 26.7.3-4); numpy has none and scipy is not a dependency."""

    def central(t: float) -> float:  # P(|T| <= t)
        theta = math.atan(t / math.sqrt(df))
        cos2, term = math.cos(theta) ** 2, 1.0
        if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 ...))
            total = 1.0 if df > 1 else 0.0
            for k in range(1, (df - 1) // 2):
                term *= 2 * k / (2 * k + 1) * cos2
                total += term
            return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
        total = 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 ...)
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * cos2
            total += term
        return math.sin(theta) * total

    low, high = 0.0, 1.0
    while central(high) < 2 * probability - 1:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if central(middle) < 2 * probability - 1 else (low, middle)
    return (low + high) / 2


def interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The interval of the mean (the module's docstring says which); None for fewer than 2 values."""
    data = np.asarray(values, dtype=np.float64)
    n = len(data)
    if n < 2:
        return None
    t = t_quantile(1 - (1 - confidence) / 2, n - 1)
    if n < BOOTSTRAP_FROM:
        half = t * float(data.std(ddof=1)) / math.sqrt(n)
        return float(data.mean()) - half, float(data.mean()) + half
    return expanded_percentile_interval(data, t)


def expanded_percentile_interval(values: Sequence[float], t: float) -> tuple[float, float]:
    """The bootstrap's percentiles at alpha' / 2 = Phi(-sqrt(n / (n - 1)) t), t the t quantile for n - 1 df."""
    n = len(values)
    tail = NormalDist().cdf(-math.sqrt(n / (n - 1)) * t)
    low, high = np.quantile(bootstrap_means(values), [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    sd: float | None  # the sample standard deviation (n - 1); None for one value
    ci95: tuple[float, float] | None

    def to_json(self) -> dict:
        return {"n": self.n, "mean": self.mean, "sd": self.sd, "ci95": list(self.ci95) if self.ci95 else None}


def summarize(values: Sequence[float]) -> Summary:
    data = np.asarray(values, dtype=np.float64)
    if len(data) == 0:
        raise ValueError("no values to summarize")
    sd = float(data.std(ddof=1)) if len(data) > 1 else None
    return Summary(len(data), float(data.mean()), sd, interval(data))


def direction(metric: str) -> int:
    """-1 where lower is better (a loss, a time), +1 where higher is (an accuracy, a throughput), 0 unknown."""
    name = metric.lower()
    if any(word in name for word in HIGHER_IS_BETTER):
        return 1
    if any(word in name for word in LOWER_IS_BETTER):
        return -1
    return 0


def seeds_needed(differences: Sequence[float], alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds for a paired t test to tell a difference of the observed mean, at the observed spread; None when
    the observed mean difference is 0 (no size to tell) or there are fewer than 2 differences."""
    data = np.asarray(differences, dtype=np.float64)
    if len(data) < 2:
        return None
    mean, sd = float(data.mean()), float(data.std(ddof=1))
    if mean == 0:
        return None
    z_alpha = NormalDist().inv_cdf(1 - alpha / 2)
    z_power = NormalDist().inv_cdf(power)
    n = (z_alpha + z_power) ** 2 * (sd / mean) ** 2 + z_alpha**2 / 2
    return max(2, math.ceil(n - 1e-9))


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    metric: str
    n: int
    mean_difference: float  # B - A
    ci95: tuple[float, float] | None
    verdict: str
    seeds_needed: int | None

    def to_json(self) -> dict:
        return {**asdict(self), "ci95": list(self.ci95) if self.ci95 else None}


def compare(a: str, b: str, metric: str, paired: Sequence[tuple[float, float]]) -> Comparison:
    """B against A on ``metric`` from (A's value, B's value) per seed."""
    differences = [y - x for x, y in paired]
    n = len(differences)
    mean = float(np.mean(differences)) if differences else math.nan
    ci = interval(differences)
    if ci is None or ci[0] <= 0 <= ci[1]:
        verdict = f"not distinguishable at n={n}"
    else:
        higher = ci[0] > 0
        sign = direction(metric)
        if sign == 0:
            verdict = f"{b} {'higher' if higher else 'lower'} than {a}"
        else:
            verdict = f"{b} {'better' if higher == (sign > 0) else 'worse'} than {a}"
    return Comparison(a, b, metric, n, mean, ci, verdict, seeds_needed(differences))
