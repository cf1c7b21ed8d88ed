"""The slow-rank rule (ddp_core/lifecycle/slow_rank.py), interval by interval: whom it names, when, and how often."""

from __future__ import annotations

import pytest

from ddp_core.lifecycle.slow_rank import SlowRank, SlowRankRule
from ddp_core.training.step_time import lower_quartile

EVEN = {2: [1.0, 1.0], 3: [1.0, 1.0, 1.0], 4: [1.0, 1.0, 1.0, 1.0]}


def slow(world: int, rank: int, factor: float = 2.0) -> list[float]:
    """One interval's compute times: every rank 1 s, ``rank`` ``factor`` s."""
    times = list(EVEN[world])
    times[rank] = factor
    return times


# (case, world size, the intervals' compute times, [(interval index, rank named, its ratio), ...])
CASES = [
    ("even", 2, [EVEN[2]] * 8, []),
    ("even", 3, [EVEN[3]] * 8, []),
    ("even", 4, [EVEN[4]] * 8, []),
    ("jitter under the ratio", 3, [[1.0, 1.2, 0.9], [1.24, 1.0, 1.0], [0.8, 1.0, 1.0]] * 3, []),
    ("exactly 1.25x is not slow", 3, [slow(3, 2, 1.25)] * 5, []),
    ("no time measured", 3, [[0.0, 0.0, 0.0]] * 5, []),
    ("1.5x but 0.5 ms a step is no slow rank", 3, [[0.001, 0.001, 0.0015]] * 5, []),
    ("3.5x and 2.5 ms a step is", 3, [[0.001, 0.001, 0.0035]] * 3, [(2, 2, 3.5)]),
    ("slow for 2 intervals", 2, [slow(2, 1), slow(2, 1), EVEN[2], slow(2, 1), slow(2, 1), EVEN[2]], []),
    ("slow for 2 intervals", 3, [slow(3, 2), slow(3, 2), EVEN[3]] * 3, []),
    ("slow for 2 intervals", 4, [slow(4, 0), slow(4, 0), EVEN[4]] * 3, []),
    # at two ranks the median is their mean: 2 s against 1 s is 2/1.5
    ("slow for 3 intervals", 2, [slow(2, 1)] * 3, [(2, 1, 2 / 1.5)]),
    ("slow for 3 intervals", 3, [EVEN[3], *[slow(3, 2)] * 3], [(3, 2, 2.0)]),
    ("slow for 3 intervals", 4, [slow(4, 3)] * 3, [(2, 3, 2.0)]),
    ("1.5x at two ranks is 1.2x their mean", 2, [slow(2, 0, 1.5)] * 5, []),
    ("said once while it stays slow", 3, [slow(3, 1)] * 10, [(2, 1, 2.0)]),
    ("two slow ranks, each named", 4, [[1.0, 2.0, 1.0, 2.0]] * 3, [(2, 1, 2 / 1.5), (2, 3, 2 / 1.5)]),
    ("the slow rank changes", 2, [slow(2, 0)] * 3 + [slow(2, 1)] * 3, [(2, 0, 2 / 1.5), (5, 1, 2 / 1.5)]),
    ("the slow rank changes", 3, [slow(3, 0)] * 4 + [slow(3, 2)] * 4, [(2, 0, 2.0), (6, 2, 2.0)]),
    ("the slow rank changes", 4, [slow(4, 1)] * 3 + [slow(4, 2, 3.0)] * 3, [(2, 1, 2.0), (5, 2, 3.0)]),
    ("recovers, then slow again", 3, [slow(3, 2)] * 3 + [EVEN[3]] + [slow(3, 2)] * 3, [(2, 2, 2.0), (6, 2, 2.0)]),
    ("recovers, then slow twice", 4, [slow(4, 2)] * 3 + [EVEN[4]] + [slow(4, 2)] * 2, [(2, 2, 2.0)]),
    (
        "recovers, then slow again",
        2,
        [slow(2, 1)] * 3 + [EVEN[2]] * 2 + [slow(2, 1)] * 3,
        [(2, 1, 4 / 3), (7, 1, 4 / 3)],
    ),
]


@pytest.mark.parametrize(("case", "world", "intervals", "expected"), CASES, ids=[f"{c[0]}-world{c[1]}" for c in CASES])
def test_the_rule_names_a_rank_slow_for_three_intervals_once(case, world, intervals, expected):
    rule = SlowRankRule()
    named = [
        (index, slow_rank.rank, slow_rank.ratio)
        for index, times in enumerate(intervals)
        for slow_rank in rule.observe(times)
    ]
    assert [(index, rank) for index, rank, _ in named] == [(index, rank) for index, rank, _ in expected], case
    assert [ratio for *_, ratio in named] == pytest.approx([ratio for *_, ratio in expected]), case


def test_a_world_of_one_names_nobody():
    rule = SlowRankRule()
    assert [rule.observe([5.0]) for _ in range(5)] == [[]] * 5


def test_the_ratio_and_the_count_are_parameters():
    rule = SlowRankRule(ratio=1.1, intervals=1)
    assert rule.observe([1.0, 1.0, 1.15]) == [SlowRank(2, pytest.approx(1.15))]


def test_a_ranks_interval_is_its_lower_quartile_step():
    assert [lower_quartile(steps) for steps in ([], [7.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(map(float, range(20))))] == [
        0.0,
        7.0,
        2.0,
        4.0,
    ]


def test_steps_the_os_delayed_make_no_rank_slow_and_a_slow_rank_is_named():
    """Rank 0 delayed at 3 of 5 steps for three intervals (as seen on a loaded 2-core machine): not named;
    rank 2 slower at every step: named."""
    delayed, even, slower = [7.9, 1.4, 1.2, 4.5, 3.2], [1.3, 1.2, 1.2, 1.0, 1.2], [21.3, 21.1, 21.2, 21.0, 21.4]
    rule = SlowRankRule()
    assert [rule.observe([lower_quartile(delayed), lower_quartile(even), lower_quartile(even)]) for _ in range(3)] == [
        []
    ] * 3
    named = [rule.observe([lower_quartile(even), lower_quartile(even), lower_quartile(slower)]) for _ in range(3)]
    assert [[slow.rank for slow in now] for now in named] == [[], [], [2]]
