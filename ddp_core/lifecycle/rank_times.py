"""Where the time and the bytes go, per rank: what each rank adds to the log interval's one collective, and what
the run makes of every rank's share.

Each log interval, every rank hands over its compute time, its time waiting in collectives, its steps and the
bytes it handed to all-reduce (``training/step_time.py``, ``training/comm.py``); ``MetricsLog`` gathers them with
the interval's loss, in the one collective it makes anyway. Every rank then feeds the same figures to TensorBoard,
the slow-rank rule (``slow_rank.py``) and metrics.json (docs/configuration.md names each).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

from ddp_core.lifecycle.slow_rank import RATIO, SlowRankRule
from ddp_core.output.logging import RankZeroWriter
from ddp_core.training.comm import CommHook
from ddp_core.training.step_time import StepTimer

log = logging.getLogger(__name__)
COMPUTE, WAIT, STEPS, SENT, QUARTILE = range(5)  # the columns of a rank's row
ADDED = QUARTILE  # the columns before it add up over the intervals; a quartile does not


class RankTimes:
    def __init__(self, timer: StepTimer, comm: CommHook, hosts: Sequence[str]) -> None:
        self.timer, self.comm, self.hosts = timer, comm, list(hosts)
        self.rule = SlowRankRule()
        self.totals: list[list[float]] = []  # per rank: its row summed over the intervals
        self.named: list[dict[str, Any]] = []  # every slow rank named: rank, host, ratio, step
        self._sent_before = comm.sent_bytes

    def restart(self) -> None:
        """What came before (set-up, a resume's settling step) is not measured."""
        self.timer.restart()
        self._sent_before = self.comm.sent_bytes

    def local(self, marked: bool = False) -> list[float]:
        """This rank's row for the interval ending now (``marked``: at the timer's last mark, a log point read late):
        compute s, comm wait s, steps, bytes sent, and the compute s of its lower-quartile step."""
        times, sent = self.timer.take(marked), self.comm.sent_bytes
        row = [times.compute_s, times.comm_wait_s, float(times.steps), float(sent - self._sent_before)]
        self._sent_before = sent
        return [*row, times.quick_step_compute_s]

    def record(self, step: int, rows: Sequence[Sequence[float]], writer: RankZeroWriter) -> None:
        """Every rank's row for the interval (the same on every rank): the scalars, the rule, the totals."""
        if not self.totals:
            self.totals = [[0.0] * ADDED for _ in rows]
        for total, row in zip(self.totals, rows):
            total[:] = [a + b for a, b in zip(total, row[:ADDED])]
        steps = rows[0][STEPS]  # every rank closes the same steps
        if steps <= 0:
            return
        scalars = {f"time/compute_rank{rank}": row[COMPUTE] / steps for rank, row in enumerate(rows)}
        scalars.update({f"time/comm_wait_rank{rank}": row[WAIT] / steps for rank, row in enumerate(rows)})
        writer.add_scalars(scalars, step)
        for slow in self.rule.observe([row[QUARTILE] for row in rows]):
            host = self.hosts[slow.rank] if slow.rank < len(self.hosts) else "?"
            self.named.append({"rank": slow.rank, "host": host, "ratio": round(slow.ratio, 3), "step": step})
            log.warning(
                f"rank {slow.rank} (host {host}) is slow: its compute time per step is {slow.ratio:.2f}x the median of "
                f"the {len(rows)} ranks' at step {step}, above {RATIO:g}x for {self.rule.intervals} log intervals in a "
                "row; the others wait for it"
            )

    def summary(self) -> dict[str, Any]:
        """metrics.json's per-rank keys; nothing before the first interval."""
        if not self.totals:
            return {}
        compute = [total[COMPUTE] for total in self.totals]
        median = statistics.median(compute)
        slowest = max(range(len(compute)), key=compute.__getitem__)
        steps = sum(total[STEPS] for total in self.totals)
        return {
            "compute_s_by_rank": [round(seconds, 6) for seconds in compute],
            "comm_wait_s_by_rank": [round(total[WAIT], 6) for total in self.totals],
            "slowest_rank": slowest,
            "slowest_rank_ratio": round(compute[slowest] / median, 3) if median > 0 else None,
            "slow_ranks_named": self.named,
            "comm_bytes_per_step": sum(total[SENT] for total in self.totals) / steps if steps else None,
        }
