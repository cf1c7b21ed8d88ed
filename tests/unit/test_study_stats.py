"""ddp_core.study.stats against values worked out by hand (docstring of each table), and one property:
on the same data, more seeds give a narrower interval."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ddp_core.study import stats

# The exact percentile bootstrap (every one of the n**n resamples), 2.5% and 97.5% by inverted_cdf:
# [1, 3]: resample means 1, 2, 2, 3 -> (1, 3).
# [0, 0, 3]: k threes ~ Binomial(3, 1/3): means 0, 1, 2, 3 with CDF 8/27, 20/27, 26/27, 1 -> (0, 3).
# [0, 0, 0, 4]: k fours ~ Binomial(4, 1/4): CDF 81, 189, 243, 255, 256 (/256); 0.975 is first reached at 3 -> (0, 3).
# [0, 1, 2, 3]: sums of 4 draws, counts 1, 4, 10, 20, ... (/256): CDF 1/256, 5/256 < 0.025 <= 15/256 at sum 2
#   -> mean 0.5; symmetric at the top: sum 10 -> 2.5.
INTERVALS = [
    ([1.0, 3.0], (1.0, 3.0)),
    ([0.0, 0.0, 3.0], (0.0, 3.0)),
    ([0.0, 0.0, 0.0, 4.0], (0.0, 3.0)),
    ([0.0, 1.0, 2.0, 3.0], (0.5, 2.5)),
    ([5.0, 5.0, 5.0], (5.0, 5.0)),
    ([7.0], None),
]


@pytest.mark.parametrize(("values", "expected"), INTERVALS)
def test_interval_by_hand(values, expected):
    got = stats.interval(values)
    assert got == (pytest.approx(expected) if expected else None)


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
    ("final_loss", [(1.0, 0.0), (2.0, 1.0)], "b better than a"),  # lower loss: better
    ("eval_accuracy", [(1.0, 0.0), (2.0, 1.0)], "b worse than a"),  # lower accuracy: worse
    ("samples_per_s", [(1.0, 2.0), (1.0, 3.0)], "b better than a"),
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
