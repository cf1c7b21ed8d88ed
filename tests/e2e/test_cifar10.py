"""The CIFAR10 experiment launched by torchrun on a synthetic dataset in the exact on-disk format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core.runs import default_outcome, read_run, show, table
from experiments.cifar10_data import CLASSES
from tests import prefork
from tests.e2e.conftest import CIFAR_TEST_IMAGES
from tests.e2e.launch import final_weights, run, torchrun, torchrun_command

# 2 processes x batch 32 = 64 images per step: 10 steps per epoch. No --log-every: its default (about 10
# points an epoch, at least one step apart) is what users see.
FAST = ("--model", "small", "--batch-size", "32", "--no-verify", "--eval-batch-size", "64")
EMA = ("--ema", "0.9")  # the reference, the stopped run and their resumes: an average of the weights beside them


def cifar10(nproc: int, run_dir: Path, data_dir: Path, *extra: str) -> Path:
    torchrun(
        nproc, "experiments.cifar10", "--run-dir", str(run_dir), "--data-dir", str(data_dir), *FAST, *extra, timeout=300
    )
    return run_dir


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory, data_dir) -> Path:
    return cifar10(2, tmp_path_factory.mktemp("cifar_runs") / "reference", data_dir, "--epochs", "2", *EMA)


def test_learns_far_above_chance_and_writes_the_run_directory(two_epochs: Path):
    metrics = json.loads((two_epochs / "metrics.json").read_text())
    assert metrics["eval_accuracy"] > 0.6  # chance is 0.1
    assert metrics["eval_samples"] == CIFAR_TEST_IMAGES
    assert metrics["images_per_s"] > 0 and metrics["wall_time_s"] > 0 and metrics["steps"] == 20
    # the first of 2 epochs is the warm-up, left out of images_per_s; 2 evaluations and 2 saves (epoch ends) apart
    assert (
        metrics["throughput_warmup_steps"] == 10 and metrics["eval_seconds"] > 0 and metrics["checkpoints_saved"] == 2
    )
    assert 0 < metrics["checkpoint_stall_ms"] <= metrics["checkpoint_stall_ms_max"]
    assert len(metrics["per_class_accuracy"]) == 10
    # --ema: the average of the weights evaluated beside them, on every test image, checkpointed with the run
    assert metrics["eval_ema_samples"] == CIFAR_TEST_IMAGES and metrics["eval_ema_accuracy"] > 0.3
    assert metrics["eval_ema_loss"] != metrics["eval_loss"]
    ema = torch.load(two_epochs / "checkpoints" / "last.pt", weights_only=True)["ema"]
    parameters = {name for name in final_weights(two_epochs) if not name.endswith(("running_mean", "running_var"))}
    assert ema["updates"] == 20 and ema["weights"].keys() == parameters - {n for n in parameters if "num_batches" in n}

    accumulator = events(two_epochs)
    tags = accumulator.Tags()
    assert {
        "train/loss",
        "train/lr",
        "train/images_per_s",
        "eval/loss",
        "eval/accuracy",
        "eval/ema_accuracy",
        "hparam/eval_accuracy",
    } <= set(tags["scalars"])
    assert {"train/augmented_batch", "eval/confusion_matrix", "eval/predictions"} <= set(tags["images"])
    assert [e.step for e in accumulator.Scalars("eval/accuracy")] == [10, 20]
    assert accumulator.Scalars("eval/accuracy")[-1].value == pytest.approx(metrics["eval_accuracy"])
    manifest = json.loads((two_epochs / "manifest.json").read_text())
    assert manifest["config"]["sync_bn"] is True and manifest["config"]["loader"] == "tensor"


def test_the_runs_table_shows_the_eval_accuracy_first(two_epochs: Path):
    manifest = json.loads((two_epochs / "manifest.json").read_text())
    assert manifest["headline"] == ["eval_accuracy", "eval_loss"]  # declared by experiments/cifar10.py
    info = read_run(two_epochs, "reference")
    metrics = json.loads((two_epochs / "metrics.json").read_text())
    assert list(info.headline)[:2] == ["eval_accuracy", "eval_loss"]
    assert info.headline["eval_accuracy"] == metrics["eval_accuracy"]
    assert default_outcome(info) == "eval_accuracy"  # a study's outcome, not images_per_s
    row = table([info]).splitlines()[1]
    assert row.split("  ")[-1].startswith(f"eval_accuracy={show(metrics['eval_accuracy'])} eval_loss=")


def events(run_dir: Path) -> EventAccumulator:
    """The run's one event file, read by TensorBoard's own reader, every event kept."""
    files = sorted(run_dir.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    accumulator = EventAccumulator(str(files[0]), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_the_default_log_interval_draws_train_loss_and_lr_curves(two_epochs: Path):
    accumulator = events(two_epochs)
    losses, lrs = accumulator.Scalars("train/loss"), accumulator.Scalars("train/lr")
    assert [e.step for e in losses] == [e.step for e in lrs] == list(range(1, 21))  # 10 steps an epoch: every step
    assert all(e.value > 0 for e in losses) and all(e.value > 0 for e in lrs)
    warmup, decay = [e.value for e in lrs[:10]], [e.value for e in lrs[10:]]  # one-cycle: a 1-epoch warm-up, then down
    assert (
        warmup == sorted(warmup)
        and decay == sorted(decay, reverse=True)
        and warmup[0] < warmup[-1]
        and decay[0] > decay[-1]
    )


def test_every_evaluation_draws_figures_and_per_class_accuracy(two_epochs: Path):
    metrics = json.loads((two_epochs / "metrics.json").read_text())
    accumulator = events(two_epochs)
    for tag in ("eval/confusion_matrix", "eval/predictions"):
        images = accumulator.Images(tag)
        assert [e.step for e in images] == [10, 20], tag
        assert images[-1].encoded_image_string.startswith(b"\x89PNG"), tag
    matrix = accumulator.Images("eval/confusion_matrix")[-1]
    assert matrix.width > 300 and matrix.height > 300  # room for names and counts (the unlabeled one was 160 x 160)
    per_class = {f"eval/accuracy_per_class/{name}": name for name in CLASSES}
    assert per_class.keys() <= set(accumulator.Tags()["scalars"])
    for tag, name in per_class.items():
        points = accumulator.Scalars(tag)
        assert [e.step for e in points] == [10, 20], tag
        assert points[-1].value == pytest.approx(metrics["per_class_accuracy"][name]), tag
    assert "eval/confusion_matrix/text_summary" in accumulator.Tags()["tensors"]  # the markdown table


@pytest.mark.parametrize("nproc, steps, every", [(1, 20, 2), (3, 6, 1)])
def test_every_test_image_is_evaluated_exactly_once(tmp_path: Path, data_dir: Path, nproc: int, steps: int, every: int):
    run_dir = cifar10(nproc, tmp_path / "run", data_dir, "--epochs", "1")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["eval_samples"] == CIFAR_TEST_IMAGES
    # and the default log interval (steps per epoch // 10, at least 1) still draws a curve
    assert metrics["steps"] == steps
    assert [e.step for e in events(run_dir).Scalars("train/loss")] == list(range(every, steps + 1, every))


@pytest.fixture(scope="module")
def stopped_mid_epoch(tmp_path_factory, data_dir) -> Path:
    """The reference run stopped at step 13 (mid-epoch: 10 steps per epoch); each test continues a copy."""
    run_dir = cifar10(
        2, tmp_path_factory.mktemp("cifar_stopped") / "run", data_dir, "--epochs", "2", "--stop-at-step", "13", *EMA
    )
    assert not (run_dir / "metrics.json").exists()  # the run has not ended
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 13
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def assert_same_end(reference: Path, resumed: Path) -> None:
    expected, actual = final_weights(reference), final_weights(resumed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key  # bitwise, running statistics included
    ends = [json.loads((run_dir / "metrics.json").read_text()) for run_dir in (reference, resumed)]
    assert ends[0]["eval_accuracy"] == ends[1]["eval_accuracy"]
    assert ends[0].get("eval_ema_accuracy") == ends[1].get("eval_ema_accuracy")


def test_resume_mid_epoch_equals_the_uninterrupted_run(
    tmp_path: Path, data_dir: Path, two_epochs: Path, stopped_mid_epoch: Path
):
    resumed = cifar10(2, copy_of(stopped_mid_epoch, tmp_path), data_dir, "--epochs", "2", "--resume", *EMA)
    assert_same_end(two_epochs, resumed)
    averages = [
        torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["ema"] for run_dir in (two_epochs, resumed)
    ]
    assert averages[0]["updates"] == averages[1]["updates"] == 20
    assert all(torch.equal(averages[0]["weights"][k], averages[1]["weights"][k]) for k in averages[0]["weights"])


def test_resume_with_the_torchvision_loader_workers_and_accumulation_is_exact(tmp_path: Path, data_dir: Path):
    variant = ("--loader", "torchvision", "--num-workers", "2", "--grad-accum", "2", "--log-every", "3")
    reference = cifar10(2, tmp_path / "reference", data_dir, "--epochs", "2", *variant)
    # an explicit --log-every wins over the default; an epoch's end adds no point, the run's end (10) is one
    assert [e.step for e in events(reference).Scalars("train/loss")] == [3, 6, 9, 10]
    interrupted = cifar10(
        2, tmp_path / "interrupted", data_dir, "--epochs", "2", "--stop-at-step", "7", *variant
    )  # 5 steps an epoch
    assert torch.load(interrupted / "checkpoints" / "last.pt", weights_only=True)["step"] == 7
    assert_same_end(reference, cifar10(2, interrupted, data_dir, "--epochs", "2", "--resume", *variant))


def test_missing_data_exits_2_with_the_ways_to_get_it(tmp_path: Path):
    result = run(
        [prefork.python(), "-m", "experiments.cifar10", "--data-dir", str(tmp_path / "nowhere"), "--model", "small"],
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "nowhere") in lines[0] and "--download" in lines[0], result.stderr


def test_corrupt_data_exits_2_naming_the_file(tmp_path: Path, data_dir: Path):
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    batch = copy / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[: batch.stat().st_size // 2])
    result = run(
        [prefork.python(), "-m", "experiments.cifar10", "--data-dir", str(copy), "--no-verify", "--model", "small"],
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "data_batch_3" in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_the_resume_check_notices_a_resume_that_loses_the_rng_states(
    tmp_path: Path, data_dir: Path, two_epochs: Path, stopped_mid_epoch: Path
):
    """Negative control: the bitwise comparison above must fail when a resume does not restore the RNG."""
    interrupted = copy_of(stopped_mid_epoch, tmp_path)
    path = interrupted / "checkpoints" / "last.pt"
    checkpoint = torch.load(path, weights_only=True)
    fresh = torch.Generator().manual_seed(12345).get_state()  # what a process that never saw the run would have
    checkpoint["rng"] = [{**state, "torch": fresh} for state in checkpoint["rng"]]
    torch.save(checkpoint, path)
    cifar10(2, interrupted, data_dir, "--epochs", "2", "--resume", *EMA)
    expected, resumed = final_weights(two_epochs), final_weights(interrupted)
    assert any(not torch.equal(expected[key], resumed[key]) for key in expected)


def test_the_resume_check_notices_a_resume_that_restarts_the_epoch(
    tmp_path: Path, data_dir: Path, two_epochs: Path, stopped_mid_epoch: Path
):
    """Negative control: a resume that replays the epoch from its first batch must end elsewhere."""
    interrupted = copy_of(stopped_mid_epoch, tmp_path)
    torchrun(
        2,
        "tests.e2e.broken_resume",
        "experiments.cifar10",
        "--run-dir",
        str(interrupted),
        "--data-dir",
        str(data_dir),
        *FAST,
        "--epochs",
        "2",
        "--resume",
        *EMA,
        timeout=300,
    )
    expected, resumed = final_weights(two_epochs), final_weights(interrupted)
    assert any(not torch.equal(expected[key], resumed[key]) for key in expected)


def test_a_killed_worker_is_restarted_and_the_run_resumes_bitwise(tmp_path: Path, data_dir: Path, two_epochs: Path):
    """Rank 1 SIGKILLed at step 7 under --max-restarts=1: the restarted group resumes from the step-4
    checkpoint and ends bitwise-equal. Static rendezvous: test_faults.py (the toy); 3 processes, killed again in each
    restarted group: test_resume_world_sizes.py, so a racy restart (docs/design.md, "Restarts and the shared
    rendezvous store") still gets several chances to show.
    SIGTERM to one rank: test_resume_world_sizes.py (3 processes); to torchrun: the contract."""
    run_dir = tmp_path / "run"
    command = torchrun_command(
        2,
        "tests.e2e.faulty",
        "experiments.cifar10",
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data_dir),
        *FAST,
        "--epochs",
        "2",
        "--checkpoint-every",
        "4",
        torchrun_args=("--standalone", "--max-restarts=1"),
    )
    result = run(command, timeout=300, FAULT="sigkill", FAULT_RANK="1", FAULT_STEP="7")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["resumed"] is True and manifest["world"]["restart_count"] == 1
    expected, resumed = final_weights(two_epochs), final_weights(run_dir)
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)
