"""The toy experiment launched by torchrun, as users launch it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core.training.profiling import PAUSE_ANNOTATION
from tests import prefork
from tests.e2e.launch import final_weights, run, torchrun, torchrun_command

# 512 samples: 16 steps per epoch at a global batch of 32, so 40 steps cross two epoch boundaries.
SMALL = ("--dataset-size", "512", "--log-every", "10")
STEPS = 40


def train(tmp: Path, name: str, nproc: int, batch: int, *extra: str, steps: int = STEPS) -> Path:
    run_dir = tmp / name
    torchrun(
        nproc,
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
        *SMALL,
        *extra,
    )
    return run_dir


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("toy"), "reference", 2, 16)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def test_run_directory_contract(two_process_run: Path):
    run_dir = two_process_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world"] == {
        "world_size": 2,
        "nodes": 1,
        "processes_per_node": 2,
        "backend": "gloo",
        "device": "cpu",
        "restart_count": 0,
        "attempt": 1,
        "nodes_range": None,  # no elastic --nnodes=MIN:MAX
    }
    assert manifest["seed"] == 0 and manifest["config"]["steps"] == STEPS
    assert set(manifest["versions"]) >= {"python", "torch", "torchvision", "cuda", "nccl"}
    assert manifest["versions"]["torch"] == torch.__version__
    assert set(manifest["git"]) == {"commit", "dirty"} and manifest["hosts"] and manifest["start_time"]
    code = manifest["code"]  # the code travels with the run: the experiment's file and the working tree's diff
    assert code["experiment"] == "code/toy.py" and code["experiment_source"].endswith("experiments/toy.py")
    assert (run_dir / code["experiment"]).read_bytes() == Path(code["experiment_source"]).read_bytes()
    if manifest["git"]["commit"] is None:  # not a git checkout (the Docker image): a note says so
        assert code["diff"] is None and code["diff_note"]
    else:
        diff = (run_dir / code["diff"]).read_text()
        assert code["diff"] == "code/git.diff" and (diff == "" or diff.startswith("diff --git")), diff[:200]

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["final_loss"] > 0 and metrics["wall_time_s"] > 0

    events = sorted(run_dir.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    losses = accumulator.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(10, STEPS + 1, 10))  # --log-every 10: the mean of each interval
    assert losses[-1].value == pytest.approx(metrics["final_loss"], rel=1e-6)
    lrs = accumulator.Scalars("train/lr")  # constant in the toy, but the same tags as CIFAR10's
    assert [e.step for e in lrs] == [e.step for e in losses] and all(e.value == pytest.approx(0.2) for e in lrs)

    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == STEPS and checkpoint["world_size"] == 2 and len(checkpoint["rng"]) == 2
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    # the one checkpoint (--checkpoint-every 50 > 40 steps: only the last step's) and last.pt naming it; no temp files
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.pt", f"step_{STEPS:08d}.pt"]
    assert (run_dir / "checkpoints" / "last.pt").samefile(run_dir / "checkpoints" / f"step_{STEPS:08d}.pt")


def test_training_reduces_the_loss(two_process_run: Path):
    events = next(two_process_run.rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    losses = [e.value for e in accumulator.Scalars("train/loss")]
    assert losses[-1] < 0.8 * losses[0]


def test_another_seed_gives_other_weights(tmp_path: Path, two_process_run: Path):
    """The same seed twice is bitwise-equal: the contract's same-seed (tests/e2e/test_contract.py)."""
    other_seed = train(tmp_path, "seed1", 2, 16, "--seed", "1")
    assert not torch.equal(final_weights(two_process_run)["net1.weight"], final_weights(other_seed)["net1.weight"])


def test_one_two_and_four_processes_agree(tmp_path: Path, two_process_run: Path):
    """Same global batch (32): the same samples are used at every step, whatever the world size."""
    reference = final_weights(two_process_run)
    for nproc in (1, 4):
        weights = final_weights(train(tmp_path, f"n{nproc}", nproc, 32 // nproc))
        for key in reference:
            torch.testing.assert_close(
                weights[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"{nproc} processes: {key}"
            )


def test_a_run_directory_is_continued_only_with_resume_and_the_same_world_size(tmp_path: Path):
    """Bitwise resume is the contract's (tests/e2e/test_contract.py); here, what a wrong relaunch gets."""
    run_dir = train(tmp_path, "two", 2, 16, steps=5)
    fresh = run(torchrun_command(2, "experiments.toy", "--run-dir", str(run_dir), "--steps", "10", *SMALL))
    assert fresh.returncode != 0 and "already holds a checkpoint" in fresh.stderr + fresh.stdout
    other_world = run(
        torchrun_command(1, "experiments.toy", "--run-dir", str(run_dir), "--steps", "10", "--resume", *SMALL)
    )
    assert other_world.returncode != 0 and "written by 2 processes" in other_world.stderr + other_world.stdout

    torchrun(
        2,
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        "--steps",
        "10",
        "--batch-size",
        "16",
        "--resume",
        "--allow-config-change",
        *SMALL,
    )
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["resumed"] is True and len(manifest["history"]) == 1 and manifest["history"][0]["resumed"] is False
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 10


def test_spawn_path_without_torchrun(tmp_path: Path):
    run_dir = tmp_path / "spawned"
    command = [
        prefork.python(),
        "-m",
        "experiments.toy",
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        "--steps",
        "5",
        *SMALL,
    ]
    result = run(command, DETERMINISTIC="1")
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world"]["world_size"] == 2 and json.loads((run_dir / "metrics.json").read_text())["steps"] == 5
    assert manifest["config"]["deterministic"] is True  # from the environment


def test_a_profiled_run_is_the_same_run_with_a_trace_per_rank(tmp_path: Path, two_process_run: Path):
    """--profile 9:2 (ddp_core/training/profiling.py) against the module's unprofiled run: bitwise the same weights
    and loss, and each rank's Chrome trace of steps 9 and 10 in the run directory, its summary logged once; the
    loop's pause to log step 10 is marked in it."""
    run_dir = tmp_path / "profiled"
    result = torchrun(
        2,
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--batch-size",
        "16",
        *SMALL,
        "--profile",
        "9:2",
    )
    assert_bitwise_equal(final_weights(run_dir), final_weights(two_process_run))
    final_loss = json.loads((run_dir / "metrics.json").read_text())["final_loss"]
    assert final_loss == json.loads((two_process_run / "metrics.json").read_text())["final_loss"]
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())
        marks = {e["name"]: e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert set(marks) == {"ProfilerStep#9", "ProfilerStep#10"}, set(marks)
        (pause,) = [e for e in trace["traceEvents"] if e.get("name") == PAUSE_ANNOTATION]  # --log-every 10
        step10 = marks["ProfilerStep#10"]
        assert step10["ts"] <= pause["ts"] and pause["ts"] + pause["dur"] <= step10["ts"] + step10["dur"]
        assert any(event.get("name") == "c10d::allreduce_" for event in trace["traceEvents"])  # DDP's, in the window
        summaries = [line for line in result.stdout.splitlines() if f"profile of steps 9..10 on rank {rank}:" in line]
        assert len(summaries) == 1 and f"[rank {rank}/2] INFO" in summaries[0], result.stdout[-3000:]
    assert sorted(path.name for path in (run_dir / "profile").iterdir()) == ["rank0.json", "rank1.json"]


def test_log_points_read_late_log_the_same_figures_and_train_the_same_run(tmp_path: Path, two_process_run: Path):
    """--log-reads late (the default on a GPU: ddp_core/lifecycle/late_reads.py) on CPU at 2 processes, against the
    module's run that reads each log point at once: bitwise the same weights; the same loss points, steps 10, 20
    and 30 read one log interval later and 40 at the run's end, each logged once and in order; every rank's steps
    counted once (the bytes per step depend on it)."""
    run_dir = tmp_path / "late"
    flags = ("--steps", str(STEPS), "--batch-size", "16", *SMALL, "--log-reads", "late")
    result = torchrun(2, "experiments.toy", "--run-dir", str(run_dir), *flags)
    assert_bitwise_equal(final_weights(run_dir), final_weights(two_process_run))

    def curve(folder: Path) -> list[tuple[int, float]]:
        events = EventAccumulator(str(folder))
        events.Reload()
        return [(point.step, point.value) for point in events.Scalars("train/loss")]

    assert curve(run_dir) == curve(two_process_run) and [step for step, _ in curve(run_dir)] == [10, 20, 30, 40]
    logged = re.findall(r"INFO step (\d+)/40  epoch \d+  loss ([0-9.]+)", result.stdout)
    assert [int(step) for step, _ in logged] == [10, 20, 30, 40], result.stdout[-3000:]
    assert [float(loss) for _, loss in logged] == pytest.approx([loss for _, loss in curve(run_dir)], abs=2e-5)
    late, now = (json.loads((folder / "metrics.json").read_text()) for folder in (run_dir, two_process_run))
    assert late["final_loss"] == now["final_loss"] and late["comm_bytes_per_step"] == now["comm_bytes_per_step"] > 0


@pytest.mark.parametrize("reads", ["now", "late"])
def test_log_every_writes_loss_points_at_its_multiples_only(tmp_path: Path, reads: str):
    """--log-every 50 with checkpoints every 30 steps, replica checks every 35 and epochs of 16 steps: those do
    their work and add no loss point; the points (TensorBoard's and the console's) fall at 50, 100, 150 only."""
    run_dir = tmp_path / reads
    cadence = ("--checkpoint-every", "30", "--check-replicas-every", "35", "--keep-checkpoints", "0")
    flags = ("--steps", "150", "--batch-size", "16", "--dataset-size", "512", "--log-every", "50", *cadence)
    result = torchrun(2, "experiments.toy", "--run-dir", str(run_dir), *flags, "--log-reads", reads)
    assert "loss every 50)" in result.stdout + result.stderr
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [point.step for point in events.Scalars("train/loss")] == [50, 100, 150]
    assert [int(step) for step in re.findall(r"INFO step (\d+)/150 ", result.stdout)] == [50, 100, 150]
    saved = sorted(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert saved == [30, 60, 90, 120, 150]  # the checkpoints were written all the same
