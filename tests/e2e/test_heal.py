"""``--heal`` with the toy at 3 processes: rank 1's worker SIGKILLed three times (in a forward pass, in a log point's
all-gather: the others in that pause, then in a forward pass again). The job ends 0, ranks 0
and 2 keep their processes, each replacement receives the state from a peer, and the final weights equal a
fault-free --heal run's, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import timeline as worker_timeline
from ddp_core.process import timeline
from tests.e2e.launch import final_weights, run, torchrun_command

FLAGS = ("--steps", "150", "--log-every", "10", "--checkpoint-every", "40", "--dataset-size", "512")
KILLS = "forward:30,gather:2,forward:20"  # one per incarnation of rank 1: three replacements


def heal_run(folder: Path, kills: str | None) -> tuple[object, list[dict]]:
    heal = ("--standalone", "--heal", "--max-restarts=3")
    module = "tests.e2e.heal_kills" if kills else "experiments.toy"
    command = torchrun_command(
        3, module, *FLAGS, "--run-dir", str(folder / "run"), torchrun_args=heal, launcher="ddp_core.torchrun"
    )
    env = worker_timeline.env(str(folder / "timeline"))
    if kills:
        env.update(HEAL_KILL_RANK="1", HEAL_KILLS=kills)
    result = run(command, timeout=300, **env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result, timeline.read(folder / "timeline")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, list[dict]]]:
    out = {}
    for name, kills in (("clean", None), ("faulted", KILLS)):
        folder = tmp_path_factory.mktemp(name)
        result, events = heal_run(folder, kills)
        out[name] = (folder / "run", result, events)
    return out


def pids_by_rank(events: list[dict]) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for event in events:
        if event["event"] == "first_step":
            found.setdefault(event["rank"], []).append(event["pid"])
    return found


def test_only_the_killed_rank_was_replaced_and_every_replacement_healed_from_a_peer(runs):
    _, _, events = runs["faulted"]
    pids = pids_by_rank(events)
    assert len(pids[0]) == len(pids[2]) == 1, pids  # ranks 0 and 2 kept their process
    assert [event["rank"] for event in events if event["event"] == "replaced"] == [1, 1, 1]
    healed = [event for event in events if event["event"] == "healed"]
    assert [event["rank"] for event in healed] == [1, 1, 1]
    assert all(event["step"] > 0 for event in healed), healed  # from a peer's state, not from the start
    assert len({event["pid"] for event in healed} | set(pids[1])) == 4  # three replacements of the first
    abandoned = {event["rank"] for event in events if event["event"] == "abandoned"}
    assert abandoned >= {0, 2}, abandoned  # the survivors saw the faults and retried


def test_the_final_weights_equal_the_fault_free_run_bitwise(runs):
    clean, faulted = final_weights(runs["clean"][0]), final_weights(runs["faulted"][0])
    assert clean.keys() == faulted.keys()
    assert all(torch.equal(clean[name], faulted[name]) for name in clean)


def test_the_logged_losses_equal_the_fault_free_run(runs):
    """A log interval a rank died in is averaged as in the fault-free run: the losses travel with the step."""

    def losses(result) -> list[str]:
        output = (result.stdout + result.stderr).splitlines()
        return [line.split("INFO ", 1)[1] for line in output if " INFO step " in line]

    clean, faulted = losses(runs["clean"][1]), losses(runs["faulted"][1])
    assert len(clean) == 15 and clean == faulted, (clean, faulted)


def test_a_healed_run_prints_no_traceback_and_one_line_per_fault_and_replacement(runs):
    _, result, _ = runs["faulted"]
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-4000:]
    assert "error" not in result.stderr.lower(), result.stderr[-4000:]
    warnings = [line.split("WARNING ", 1)[1] for line in output.splitlines() if " WARNING " in line]
    assert len(warnings) == 6, warnings
    assert sum(line.startswith("rank 1 replaces a dead worker") for line in warnings) == 3, warnings


def test_a_worker_dead_before_its_first_step_is_one_report_not_a_heal(tmp_path: Path):
    """No peer has trained a step to heal from: the job ends as a killed worker's does without --heal."""
    heal = ("--standalone", "--heal", "--max-restarts=3")
    command = torchrun_command(
        3,
        "tests.e2e.heal_kills",
        *FLAGS,
        "--run-dir",
        str(tmp_path / "run"),
        torchrun_args=heal,
        launcher="ddp_core.torchrun",
    )
    result = run(command, timeout=300, HEAL_KILL_RANK="1", HEAL_KILLS="forward:1")
    output = result.stdout + result.stderr
    assert result.returncode == 137, output[-4000:]
    reports = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(reports) == 1 and reports[0].startswith("error: rank 1 (host "), output[-4000:]


def test_cifar10_small_with_sync_bn_and_an_ema_heals_twice_bitwise(tmp_path: Path, data_dir: Path):
    """Batch norm over the global batch (collectives inside the forward and backward passes), an average of the
    weights updated after each optimizer step, augmentations drawn from each rank's stream: a worker killed in a
    step, then after one; every state of the last checkpoint equals the fault-free --heal run's."""
    flags = ("--model", "small", "--batch-size", "32", "--no-verify", "--eval-batch-size", "64", "--epochs", "3")
    flags += ("--ema", "0.9", "--data-dir", str(data_dir))
    heal = ("--standalone", "--heal", "--max-restarts=2")
    for name, module in (("clean", "experiments.cifar10"), ("faulted", "tests.e2e.heal_kills")):
        command = torchrun_command(
            3, module, *flags, "--run-dir", str(tmp_path / name), torchrun_args=heal, launcher="ddp_core.torchrun"
        )
        env = {"HEAL_EXPERIMENT": "experiments.cifar10", "HEAL_KILL_RANK": "1", "HEAL_KILLS": "forward:4,after:4"}
        result = run(command, timeout=300, **env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    output = result.stdout + result.stderr
    assert sum(" replaces a dead worker" in line for line in output.splitlines()) == 2, output[-3000:]
    clean, faulted = (
        torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True) for name in ("clean", "faulted")
    )
    for state in ("model", "optimizer", "ema", "position", "metrics"):
        assert_equal_states(clean[state], faulted[state], state)


def assert_equal_states(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_states(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_equal_states(x, y, f"{where}[{index}]")
    else:
        assert a == b, where
