"""An experiment's own objects in the checkpoint (``run.track``; tests/e2e/tracked_toy.py): a stop and --resume ends
with the weights, the replicated object and every rank's own object of the run that never stopped, bit for bit,
at 2 and 3 processes. A resume that does not track a name the checkpoint holds is one line, exit 2; a replicated
object that differs on one rank stops the run like a replica drift (exit 5), naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_core.exit_codes import REPLICAS_DIVERGED_EXIT_CODE
from tests import prefork
from tests.e2e.launch import run

TOY = ("--steps", "8", "--batch-size", "8", "--dataset-size", "240", "--log-every", "4", "--checkpoint-every", "4")
STOP_AT = 5


def launch(nproc: int, run_dir: Path, *flags: str, **env: str):
    command = [prefork.python(), "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={nproc}"]
    return run([*command, "-m", "tests.e2e.tracked_toy", "--run-dir", str(run_dir), *TOY, *flags], timeout=300, **env)


def finished(nproc: int, run_dir: Path, *flags: str) -> dict[str, Any]:
    result = launch(nproc, run_dir, *flags)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_resume_restores_the_experiments_own_objects_bitwise(tmp_path: Path, nproc: int):
    whole = finished(nproc, tmp_path / "whole")
    stopped = finished(nproc, tmp_path / "run", "--stop-at-step", str(STOP_AT))
    assert stopped["step"] == STOP_AT and stopped["drift"]["count"] == STOP_AT
    assert len(stopped["tally"]) == nproc and "tally" in stopped["per_rank"] and "drift" not in stopped["per_rank"]
    assert len({float(state["total"].sum()) for state in stopped["tally"]}) == nproc  # each rank's own
    if nproc == 2:  # the resume must track what the checkpoint holds
        refused = launch(nproc, tmp_path / "run", "--resume", TRACKED_TOY_SKIP="tally")
        errors = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
        assert "tally, which this run does not track" in errors[0], errors[0]
    resumed = finished(nproc, tmp_path / "run", "--resume")
    assert whole["drift"]["count"] == 8 and whole["tally"][0]["batches"] == 8
    for name in ("model", "optimizer", "drift", "tally"):
        assert same(whole[name], resumed[name]), name


def test_a_replicated_object_that_differs_on_one_rank_is_named_like_a_replica_drift(tmp_path: Path):
    result = launch(3, tmp_path / "run", "--check-replicas-every", "3", TRACKED_TOY_SKEW_RANK="1")
    assert result.returncode == REPLICAS_DIVERGED_EXIT_CODE, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: replicas diverged at step 3: drift (tracked, replicated): rank(s) 1 differ from rank(s) 0, 2;"
    ), result.stderr[-3000:]
