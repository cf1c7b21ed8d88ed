"""The replica check at 3 processes, launched as users launch it: a rank whose weight was perturbed is caught
at the next check, every rank stops at that step with exit 5 and one line naming the parameter and the rank,
and the last checkpoint (of agreeing replicas) is kept and named, even when its write was still in flight at the
check (a slow disk: the line named no checkpoint when a loaded machine wrote it late); a healthy run checked at
every step ends bitwise equal to one never checked."""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_core.exit_codes import REPLICAS_DIVERGED_EXIT_CODE
from tests import prefork
from tests.e2e.launch import final_weights, run

TOY = ("--steps", "12", "--batch-size", "8", "--dataset-size", "240", "--log-every", "3")


def toy(nproc: int, run_dir: Path, *flags: str, module: tuple[str, ...] = ("experiments.toy",), **env: str):
    command = [prefork.python(), "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", *module]
    return run([*command, "--run-dir", str(run_dir), *TOY, *flags], timeout=300, **env)


def test_a_perturbed_rank_is_named_at_the_next_check_and_nothing_is_saved_after_it(tmp_path: Path):
    run_dir = tmp_path / "run"
    result = toy(
        3,
        run_dir,
        "--check-replicas-every",
        "4",
        "--checkpoint-every",
        "5",
        module=("bench.perturbed_replica", "experiments.toy"),
        PERTURB_RANK="2",
        PERTURB_STEP="6",
        PERTURB_NAME="net2.bias",
        SLOW_WRITE_S="2",  # step 5's checkpoint is still being written at step 8's check
    )
    assert result.returncode == REPLICAS_DIVERGED_EXIT_CODE, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]  # printed once, by rank 0
    assert errors[0].startswith("error: replicas diverged at step 8: net2.bias: rank(s) 2 differ from rank(s) 0, 1;"), (
        errors[0]
    )
    assert "the last check that agreed was at step 5" in errors[0]  # the check before step 5's checkpoint
    assert f"--resume continues from {run_dir / 'checkpoints' / 'last.pt'}" in errors[0]
    assert "Traceback" not in result.stdout + result.stderr
    saved = sorted(path.name for path in (run_dir / "checkpoints").glob("step_*.pt"))
    assert saved == ["step_00000005.pt"]  # none from the diverged state
    assert not (run_dir / "metrics.json").exists()


def test_a_healthy_run_checked_every_step_is_bitwise_equal_to_one_never_checked(tmp_path: Path):
    for every in ("1", "0"):
        result = toy(3, tmp_path / every, "--check-replicas-every", every)
        assert result.returncode == 0, result.stderr[-3000:]
    checked, unchecked = final_weights(tmp_path / "1"), final_weights(tmp_path / "0")
    assert checked.keys() == unchecked.keys()
    assert all(torch.equal(checked[name], unchecked[name]) for name in checked)
