"""tools.study.stats against values worked out by hand (docstring of each table), and one property:
on the same data, more seeds give a narrower interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tools.study import stats

# Below 10 seeds, Student's t: mean -+ t_{0.975, n-1} sd / sqrt(n), with t = 12.7062 (1 df), 4.3027 (2),
# 3.1824 (3), 2.7764 (4). [1, 3]: mean 2, sd sqrt(2), se 1. [0, 0, 3]: mean 1, sd sqrt(3), se 1.
# [0, 0, 0, 4]: mean 1, sd 2, se 1. [0, 1, 2, 3, 4]: mean 2, sd sqrt(2.5), se sqrt(0.5).
INTERVALS = [
    ([1.0, 3.0], (2 - 12.7062, 2 + 12.7062)),
    ([0.0, 0.0, 3.0], (1 - 4.3027, 1 + 4.3027)),
    ([0.0, 0.0, 0.0, 4.0], (1 - 3.1824, 1 + 3.1824)),
    ([0.0, 1.0, 2.0, 3.0, 4.0], (2 - 2.7764 * math.sqrt(0.5), 2 + 2.7764 * math.sqrt(0.5))),
    ([5.0, 5.0, 5.0], (5.0, 5.0)),
    ([7.0], None),
]


@pytest.mark.parametrize(("values", "expected"), INTERVALS)
def test_interval_by_hand(values, expected):
    got = stats.interval(values)
    assert got == (pytest.approx(expected, abs=1e-4) if expected else None)


# The expanded percentile bootstrap, exact (all 5**5 = 3,125 resamples), by inverted_cdf, t = 2.7764 (4 df):
# alpha'/2 = Phi(-sqrt(5/4) * 2.7764) = Phi(-3.104) = 0.00095.
# [0, 1, 2, 3, 4]: the resample sum is 0 in 1/3125 = 0.00032 of them, at most 1 in 6/3125 = 0.0019 -> mean
#   1/5; symmetric at the top -> 19/5.
# [0, 0, 0, 0, 5]: P(no 5 drawn) = (4/5)^5 = 0.328 -> 0; k fives ~ Binomial(5, 1/5), P(k <= 3) = 0.9933,
#   P(k <= 4) = 0.99968 >= 1 - 0.00095 -> mean 4.
@pytest.mark.parametrize(
    ("values", "expected"), [([0.0, 1.0, 2.0, 3.0, 4.0], (0.2, 3.8)), ([0.0, 0.0, 0.0, 0.0, 5.0], (0.0, 4.0))]
)
def test_expanded_bootstrap_by_hand(values, expected):
    assert stats.expanded_percentile_interval(values, 2.7764) == pytest.approx(expected)


@pytest.mark.parametrize(("df", "quantile"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_against_the_printed_tables(df, quantile):
    assert stats.t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-4)


@pytest.mark.parametrize("n", [3, 5, 10, 20])
def test_interval_holds_the_mean_about_95_percent_of_the_time(n):
    """Simulated seeds (normal, a fixed stream): the interval holds the true mean 0 in 90-99% of 400 studies.
    The plain percentile bootstrap fails this at 3 seeds (75%) and 5 (86%)."""
    rng = np.random.default_rng(n)
    held = sum(low <= 0 <= high for low, high in (stats.interval(rng.standard_normal(n)) for _ in range(400)))
    assert 0.90 <= held / 400 <= 0.99


# mean, sample sd (n - 1)
SUMMARIES = [
    ([1.0, 2.0, 3.0, 4.0], 2.5, math.sqrt(5 / 3)),
    ([2.0, 4.0], 3.0, math.sqrt(2)),
    ([7.0], 7.0, None),
]


@pytest.mark.parametrize(("values", "mean", "sd"), SUMMARIES)
def test_summary_by_hand(values, mean, sd):
    summary = stats.summarize(values)
    assert summary.n == len(values) and summary.mean == pytest.approx(mean)
    assert summary.sd == (pytest.approx(sd) if sd is not None else None)


# n = (z_0.975 + z_0.80)^2 (sd/mean)^2 + z_0.975^2 / 2, with (1.959964 + 0.841621)^2 = 7.848861 and
# 1.959964^2 / 2 = 1.920729; rounded up, at least 2.
SEEDS_NEEDED = [
    ([1.0, 1.0], 2),  # sd 0: 1.92 -> 2
    ([1.0, 3.0], 6),  # mean 2, sd sqrt(2): 7.8489 * 0.5 + 1.9207 = 5.845
    ([-1.0, -3.0], 6),  # the sign does not matter
    ([0.0, 2.0, 4.0], 10),  # mean 2, sd 2: 7.8489 + 1.9207 = 9.77
    ([1.0, 5.0], 9),  # mean 3, sd 2.828: 7.8489 * 8 / 9 + 1.9207 = 8.90
    ([1.0, -1.0], None),  # no difference observed
    ([2.0], None),  # one seed: no spread
]


@pytest.mark.parametrize(("differences", "expected"), SEEDS_NEEDED)
def test_seeds_needed_by_hand(differences, expected):
    assert stats.seeds_needed(differences) == expected


VERDICTS = [
    ("final_loss", [(1.0, 0.0), (2.0, 1.0)], "b better than a"),  # -1 every seed (sd 0): lower loss, better
    ("eval_accuracy", [(1.0, 0.0), (2.0, 1.0)], "b worse than a"),  # lower accuracy: worse
    ("final_loss", [(1.0, 0.0), (2.0, 1.5)], "not distinguishable at n=2"),  # -0.75 -+ 12.7 * 0.25
    ("samples_per_s", [(1.0, 2.0), (1.0, 3.0), (1.0, 2.5)], "b better than a"),  # +1.5 -+ 4.30 * 0.29
    ("widgets", [(1.0, 0.0), (2.0, 1.0)], "b lower than a"),  # no known direction
    ("final_loss", [(0.0, 1.0), (0.0, -1.0)], "not distinguishable at n=2"),
    ("final_loss", [(0.0, 1.0)], "not distinguishable at n=1"),
]


@pytest.mark.parametrize(("metric", "paired", "verdict"), VERDICTS)
def test_verdict_by_hand(metric, paired, verdict):
    comparison = stats.compare("a", "b", metric, paired)
    assert comparison.verdict == verdict
    assert comparison.mean_difference == pytest.approx(sum(y - x for x, y in paired) / len(paired))


def test_bootstrap_is_reproducible_beyond_the_exact_size():
    values = [float(v) for v in range(20)]
    assert stats.interval(values) == stats.interval(values)
    low, high = stats.interval(values)
    assert low < 9.5 < high


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False),
        min_size=2,
        max_size=6,
    ),
    st.integers(min_value=4, max_value=8),
)
def test_interval_narrows_as_seeds_grow(values, times):
    """The same spread measured on `times` times as many seeds (the values repeated): a narrower interval."""
    assume(max(values) - min(values) > 1e-3)
    few, many = stats.interval(values), stats.interval(values * times)
    assert few[0] <= sum(values) / len(values) <= few[1]
    assert many[1] - many[0] < few[1] - few[0]
