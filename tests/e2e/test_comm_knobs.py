"""DDP's own knobs (--comm-hook, --zero, ...) with their state in the resume: a stop and --resume ends with the
weights of the run that never stopped, bit for bit, at 1, 2 and 3 processes, for the toy, CIFAR10 small and charlm.

PowerSGD keeps per-rank state (error feedback, warm-start factors, its step count, its random stream) that a
resume must put back: the negative control drops it and must end elsewhere. ZeRO shards the optimizer state:
the checkpoint holds it whole, and a resume re-shards it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import prefork
from tests.e2e.launch import final_weights, run

POWERSGD = ("--comm-hook", "powersgd", "--powersgd-start-step", "3")
FLAGS = {  # 8 steps an epoch at 2 processes, 5 at 3: the stop at step 11 is mid-epoch, after the checkpoint at 9
    "toy": ("--dataset-size", "256", "--batch-size", "16", "--steps", "20", "--checkpoint-every", "9"),
    "cifar10": ("--model", "small", "--batch-size", "32", "--no-verify", "--epochs", "2", "--eval-batch-size", "64"),
    "charlm": ("--steps", "16", "--warmup-steps", "3", "--block", "16", "--width", "32", "--eval-every", "8"),
}
STOP_AT = 11
CASES = [
    ("toy", 1, POWERSGD),  # one process: DDP still rebuilds its buckets, which PowerSGD's state follows
    ("toy", 2, ("--comm-hook", "fp16")),
    ("toy", 3, ("--comm-hook", "fp16")),
    ("toy", 2, ("--comm-hook", "bf16")),
    ("toy", 3, ("--comm-hook", "bf16")),
    ("toy", 2, (*POWERSGD, "--zero")),
    ("toy", 3, (*POWERSGD, "--zero")),
    ("cifar10", 3, (*POWERSGD, "--zero", "--checkpoint-every", "4")),
    ("charlm", 2, (*POWERSGD, "--zero", "--checkpoint-every", "4")),
]


def command(experiment: str, nproc: int, run_dir: Path, data_dir: Path, *extra: str, module: str = "") -> list[str]:
    target = ("-m", module, f"experiments.{experiment}") if module else ("-m", f"experiments.{experiment}")
    data = ("--data-dir", str(data_dir)) if experiment == "cifar10" else ()
    launcher = (prefork.python(), "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={nproc}")
    return [*launcher, *target, "--run-dir", str(run_dir), *data, *FLAGS[experiment], *extra]


def launch(*args: object, env: dict[str, str] | None = None, **kwargs: str) -> None:
    result = run(command(*args, **kwargs), timeout=300, **(env or {}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def differing(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    return [key for key in expected if not torch.equal(expected[key], actual[key])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def weights(experiment: str, nproc: int, knobs: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if (experiment, nproc, knobs) not in cache:
            run_dir = tmp_path_factory.mktemp("reference") / experiment
            launch(experiment, nproc, run_dir, data_dir, *knobs)
            cache[experiment, nproc, knobs] = final_weights(run_dir)
        return cache[experiment, nproc, knobs]

    return weights


@pytest.mark.parametrize(("experiment", "nproc", "knobs"), CASES, ids=[f"{e}-{n}-{k[1]}{k[-1]}" for e, n, k in CASES])
def test_stop_and_resume_with_a_knob_is_bitwise(tmp_path, data_dir, reference, experiment, nproc, knobs):
    launch(experiment, nproc, tmp_path / "run", data_dir, *knobs, "--stop-at-step", str(STOP_AT))
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == STOP_AT
    if "powersgd" in knobs:  # every rank's own error feedback is in the checkpoint
        hooks = checkpoint["comm_hook"]
        assert len(hooks) == nproc and all(state["iter"] > 3 and state["error_dict"] for state in hooks)
    launch(experiment, nproc, tmp_path / "run", data_dir, *knobs, "--resume")
    assert differing(reference(experiment, nproc, knobs), final_weights(tmp_path / "run")) == []


def test_a_resume_that_drops_powersgds_state_ends_elsewhere(tmp_path, data_dir, reference):
    """Negative control: the hook's state saved but not put back (pytorch/pytorch#75666's trap)."""
    knobs = (*POWERSGD, "--zero")
    launch("toy", 2, tmp_path / "run", data_dir, *knobs, "--stop-at-step", str(STOP_AT))
    broken = {"BROKEN_RESUME": "hook_state"}
    launch("toy", 2, tmp_path / "run", data_dir, *knobs, "--resume", module="tests.e2e.broken_resume", env=broken)
    assert differing(reference("toy", 2, knobs), final_weights(tmp_path / "run")) != []


def test_zero_and_the_hooks_can_be_switched_on_a_resume_at_another_world_size(tmp_path, data_dir):
    """A ZeRO checkpoint of 2 processes re-shards onto 3; PowerSGD's per-rank error feedback starts afresh, with
    one warning line; the run ends with its metrics."""
    knobs = (*POWERSGD, "--zero")
    launch("toy", 2, tmp_path / "run", data_dir, *knobs, "--stop-at-step", str(STOP_AT))
    result = run(command("toy", 3, tmp_path / "run", data_dir, *knobs, "--resume", "--allow-config-change"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("--comm-hook powersgd starts its error feedback afresh") == 1
    assert (tmp_path / "run" / "metrics.json").is_file()
