"""bench.recovery's figures for a pair of runs: goodput as the two runs' training times give it, and as the
breakdown of each fault gives it (the faults' own lost seconds, whatever the machine's pace did between runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.recovery import Fault, Job, summarise
from ddp_core.layout import METRICS


def job(tmp_path: Path, name: str, train_s: float, faults: list[Fault], steps: int = 100) -> Job:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / METRICS).write_text(json.dumps({"steps": steps}))
    return Job(returncode=0, wall_s=train_s + 5, train_s=train_s, faults=faults, run_dir=run_dir)


@pytest.mark.parametrize(
    ("clean_s", "faulted_s", "lost", "expected_by_phase"),
    [
        (10.0, 12.0, [(0.5, 5), (0.5, 0)], 1 - 1.5 / 12),  # 5 lost steps at 10 steps/s: 0.5 s more
        (10.0, 8.0, [(0.25, 0)], 1 - 0.25 / 8),  # the faulted run outran its twin: goodput over 1, not the faults'
        (20.0, 20.0, [], 1.0),
    ],
)
def test_goodput_by_the_runs_and_by_the_breakdown(tmp_path, clean_s, faulted_s, lost, expected_by_phase):
    faults = [Fault(kill=0.0, rank=1, step=10, lost_s=seconds, steps_lost=steps) for seconds, steps in lost]
    row = summarise(job(tmp_path, "faulted", faulted_s, faults), job(tmp_path, "clean", clean_s, []))
    assert row["pace"] == pytest.approx(100 / clean_s)
    assert row["goodput"] == pytest.approx(clean_s / faulted_s)
    assert row["goodput_by_phase"] == pytest.approx(expected_by_phase)
    assert row["lost_per_fault_s"] == pytest.approx((faulted_s - clean_s) / max(len(lost), 1))
    assert row["bitwise"] is False  # no checkpoints to compare


def event(t: float, name: str, rank: int | None, pid: int, **fields) -> dict:
    return {"t": t, "event": name, "rank": rank, "pid": pid, "restart": 0, **fields}


# --heal at 2 processes: rank 1's worker (pid 11) killed at t=10, its client (pid 21) forks pid 12
HEALED = [
    event(0.0, "spawned", None, 1, job_dir="/job"),
    *[event(1.0 + rank / 10, "first_step", rank, 10 + rank, step=1) for rank in (0, 1)],
    event(10.1, "abandoned", 0, 10, step=50),
    event(10.2, "replaced", 1, 21, replacement=1, code=-9),
    event(10.3, "imported", 1, 12),
    event(10.5, "healed", 1, 12, step=50),
    event(10.6, "first_step", 1, 12, step=51),
]


def test_under_heal_each_phase_is_timed_from_the_kill_and_the_next_kill_waits_for_the_replacements_first_step():
    from bench import recovery_heal

    fault = Fault(kill=10.0, rank=1, step=50, pid=11)
    up, pids, job_dir = recovery_heal.scene(HEALED[:-1], [fault], 2)
    assert up is None and pids == {0: 10, 1: 11}  # the replacement has not trained yet
    up, pids, job_dir = recovery_heal.scene(HEALED, [fault], 2)
    assert (up, pids, job_dir) == (10.6, {0: 10, 1: 12}, "/job")
    recovery_heal.measure_faults([fault], HEALED)
    expected = {"detection": 0.1, "client's replacement": 0.2, "replacement up": 0.3, "state received": 0.5}
    assert fault.phases == pytest.approx({**expected, "first step": 0.6})
    assert fault.lost_s == pytest.approx(0.6) and fault.abandoned == 1 and fault.steps_lost == 0


def test_survivors_kept_their_processes_only_where_each_rank_had_one_worker_more_than_its_kills(tmp_path):
    from bench import recovery_heal

    healed = job(tmp_path, "healed", 5.0, [Fault(kill=10.0, rank=1, step=50, pid=11)])
    healed.events = HEALED
    assert recovery_heal.survivors_kept(healed)
    healed.events = [*HEALED, event(11.0, "imported", 0, 13)]  # rank 0, never killed, had a new process
    assert not recovery_heal.survivors_kept(healed)
    healed.events, healed.faults = HEALED, []  # or rank 1's worker died of something else
    assert not recovery_heal.survivors_kept(healed)
