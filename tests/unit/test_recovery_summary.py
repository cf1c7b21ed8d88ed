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
