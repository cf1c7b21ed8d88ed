"""The slow-rank rule: which rank to name, and when, from the ranks' compute time of each log interval.

A rank is slow in an interval when its compute time is above ``RATIO`` x the ranks' median (itself counted: at two
ranks the slower needs 5/3 x the other's) and at least ``MIN_EXCESS_S`` above it. Slow for ``INTERVALS`` intervals
in a row, it is named once, and again only after an interval in which it recovered; a world of one names nobody.
Compute, not step time: the ranks that wait for a slow one spend the same step time, in a collective (the quartile
and the 2 ms: docs/decisions.md, "Where the time and the bytes go, per rank").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

RATIO = 1.25
INTERVALS = 3
MIN_EXCESS_S = 0.002


@dataclass(frozen=True)
class SlowRank:
    rank: int
    ratio: float  # its compute time over the median of the ranks', in the interval that named it


class SlowRankRule:
    """Fed every log interval's per-rank compute times (the same on every rank), it says whom to name now."""

    def __init__(self, ratio: float = RATIO, intervals: int = INTERVALS, min_excess_s: float = MIN_EXCESS_S) -> None:
        self.ratio, self.intervals, self.min_excess_s = ratio, intervals, min_excess_s
        self._streak: dict[int, int] = {}  # rank: consecutive slow intervals up to the last one
        self._named: set[int] = set()  # ranks named in their current slow streak

    def observe(self, compute: Sequence[float]) -> list[SlowRank]:
        """The ranks to name after this interval: slow for the ``intervals``-th time in a row, not yet named."""
        median = statistics.median(compute) if compute else 0.0
        named = []
        for rank, seconds in enumerate(compute):
            if median <= 0 or seconds <= self.ratio * median or seconds - median < self.min_excess_s:
                self._streak.pop(rank, None)  # recovered (or never slow): a new streak starts from zero
                self._named.discard(rank)
                continue
            self._streak[rank] = self._streak.get(rank, 0) + 1
            if self._streak[rank] >= self.intervals and rank not in self._named:
                self._named.add(rank)
                named.append(SlowRank(rank, seconds / median))
        return named
