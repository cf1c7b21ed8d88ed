"""A diverging run stops on every rank with exit 3 and one line, and no checkpoint holds a non-finite value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core.exit_codes import DIVERGED_EXIT_CODE
from ddp_core.runs import read_run
from tests import prefork
from tests.e2e.launch import run

TOY = ("--dataset-size", "512", "--batch-size", "16", "--steps", "40")
CIFAR = (
    "--model",
    "small",
    "--batch-size",
    "32",
    "--no-verify",
    "--log-every",
    "2",
    "--eval-batch-size",
    "64",
    "--epochs",
    "2",
    "--checkpoint-every",
    "4",
)


def launch(nproc: int, module: str, *args: str, **env: str):
    command = [
        prefork.python(),
        "-m",
        "ddp_core.torchrun",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]
    return run(command, timeout=300, **env)


def assert_stopped_cleanly(result, run_dir: Path, checkpoint_step: int | None) -> str:
    """Exit 3, one error line (rank 0's), and a last checkpoint (if any) of only finite values."""
    output = result.stdout + result.stderr
    assert result.returncode == DIVERGED_EXIT_CODE, output[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    assert not (run_dir / "metrics.json").exists()
    assert read_run(run_dir, "run").status == "diverged"  # rank 0 recorded exit 3 in manifest.json
    checkpoint = run_dir / "checkpoints" / "last.pt"
    if checkpoint_step is None:
        assert not checkpoint.exists()
        return errors[0]
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == checkpoint_step
    assert all(torch.isfinite(value).all() for value in state["model"].values())
    assert str(checkpoint) in errors[0]  # named as the one to go back to
    return errors[0]


# Read at once: checkpoints every 5 steps, log points every 10. Read late (--log-reads late, the default on a GPU):
# checkpoints every 10, log points every 4, each read at the next (ddp_core/lifecycle/late_reads.py).
NOW = ("--checkpoint-every", "5", "--log-every", "10")
LATE = ("--checkpoint-every", "10", "--log-every", "4", "--log-reads", "late")


@pytest.mark.parametrize(
    ("nproc", "reads", "stop", "curve"),
    [(2, NOW, 15, [10]), (3, NOW, 15, [10]), (2, LATE, 16, [4, 8]), (3, LATE, 16, [4, 8])],
)
def test_a_nan_loss_on_the_last_rank_stops_the_toy_before_its_next_checkpoint(
    tmp_path: Path, nproc: int, reads: tuple[str, ...], stop: int, curve: list[int]
):
    """NaN in step 12 on the last rank only; checkpoint 10 was taken after a passed check. Read at once, the check
    before the step-15 checkpoint stops every rank; read late, the log point at 12 sends the verdict and the one at
    16 reads every rank's and stops them all there, before the step-20 checkpoint."""
    result = launch(
        nproc,
        "tests.e2e.faulty",
        "experiments.toy",
        "--run-dir",
        str(tmp_path / "run"),
        *TOY,
        *reads,
        FAULT="nan_loss",
        FAULT_RANK=str(nproc - 1),
        FAULT_STEP="12",
    )
    line = assert_stopped_cleanly(result, tmp_path / "run", checkpoint_step=10)
    # TensorBoard's writer was left open by the failure: flushed on the way out, the curve holds the log points
    # before the bad step (a checkpoint adds none)
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [point.step for point in events.Scalars("train/loss")] == curve
    assert (
        f"became nan at step 12 (rank {nproc - 1})" in line
        and f"stopped at step {stop}" in line
        and f"a lower learning rate (step {stop}'s was" in line
    ), line


def test_a_learning_rate_that_explodes_stops_the_toy_at_3_processes(tmp_path: Path):
    result = launch(3, "experiments.toy", "--run-dir", str(tmp_path / "run"), *TOY, *NOW, "--lr", "1e6")
    line = assert_stopped_cleanly(result, tmp_path / "run", checkpoint_step=None)
    assert (
        "a lower learning rate (step" in line
        and "'s was 1e+06)" in line
        and "no checkpoint had been written yet" in line
    )


@pytest.mark.parametrize(("nproc", "last_good"), [(2, 4), (3, 6)])  # 10 and 6 steps per epoch
def test_a_nan_loss_stops_cifar10_before_the_next_checkpoint(
    tmp_path: Path, data_dir: Path, nproc: int, last_good: int
):
    """NaN in step 7 on the last rank: the log-step check at step 8 stops every rank, before step 8's checkpoint."""
    result = launch(
        nproc,
        "tests.e2e.faulty",
        "experiments.cifar10",
        "--run-dir",
        str(tmp_path / "run"),
        "--data-dir",
        str(data_dir),
        *CIFAR,
        FAULT="nan_loss",
        FAULT_RANK=str(nproc - 1),
        FAULT_STEP="7",
    )
    line = assert_stopped_cleanly(result, tmp_path / "run", checkpoint_step=last_good)
    assert f"became nan at step 7 (rank {nproc - 1})" in line and "stopped at step 8" in line
