"""A resume continues the same run or says why not, in one line printed once: another value of an option
that changes the computation, another experiment, another world size. Options that cannot change it may
differ; --allow-config-change continues anyway and manifest.json records the change. Toy and CIFAR10,
at 1 and 2 processes, launched as users launch them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.process.launch import free_port
from tests import prefork
from tests.e2e.launch import REPO, clean_env, run, torchrun_command

TOY = ("--steps", "12", "--batch-size", "16", "--dataset-size", "256", "--checkpoint-every", "4", "--log-every", "4")
CIFAR = (
    "--model",
    "small",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--eval-batch-size",
    "64",
    "--no-verify",
    "--checkpoint-every",
    "2",
)


def launch(nproc: int, module: str, *args: str):
    if nproc == 1:
        command = [prefork.python(), "-m", module, *args]
    else:
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
    return run(command, timeout=300)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, data_dir: Path) -> dict[str, Path]:
    """Runs stopped at step 3, one per experiment and world size, for each case to continue a copy of."""
    runs = {}
    for name, nproc, module, flags in (
        ("toy-1", 1, "experiments.toy", TOY),
        ("toy-2", 2, "experiments.toy", TOY),
        ("cifar10-1", 1, "experiments.cifar10", (*CIFAR, "--data-dir", str(data_dir))),
        ("cifar10-2", 2, "experiments.cifar10", (*CIFAR, "--data-dir", str(data_dir))),
    ):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        result = launch(nproc, module, "--run-dir", str(run_dir), *flags, "--stop-at-step", "3")
        assert result.returncode == 0 and (run_dir / "checkpoints" / "last.pt").exists(), (
            result.stdout[-2000:] + result.stderr[-2000:]
        )
        runs[name] = run_dir
    return runs


REFUSED = [  # (stopped run, processes now, module now, flags now, the one line's words)
    ("toy-1", 1, "experiments.toy", ("--batch-size", "8"), "--batch-size: 16 -> 8"),
    ("toy-2", 2, "experiments.toy", ("--batch-size", "8", "--lr", "0.5"), "--batch-size: 16 -> 8, --lr: 0.2 -> 0.5"),
    ("toy-2", 2, "experiments.toy", ("--seed", "7"), "--seed: 0 -> 7"),
    (
        "cifar10-1",
        1,
        "experiments.cifar10",
        ("--batch-size", "16", "--no-sync-bn"),
        "--batch-size: 32 -> 16, --sync-bn: True -> False",
    ),
    ("cifar10-2", 2, "experiments.cifar10", ("--lr", "0.5"), "--lr: 0.2 -> 0.5"),
    ("cifar10-2", 2, "experiments.cifar10", ("--model", "resnet18"), "--model: 'small' -> 'resnet18'"),
    (
        "toy-2",
        2,
        "experiments.cifar10",
        (),
        "was written by experiment toy, not cifar10: resume it with python -m experiments.toy",
    ),
    ("toy-1", 2, "experiments.toy", (), "the checkpoint was written by 1 processes and this run has 2"),
    ("toy-2", 1, "experiments.toy", (), "the checkpoint was written by 2 processes and this run has 1"),
]


def flags_of(name: str, data_dir: Path) -> tuple[str, ...]:
    return TOY if name.startswith("toy") else (*CIFAR, "--data-dir", str(data_dir))


@pytest.mark.parametrize(
    ("name", "nproc", "module", "changed", "words"),
    REFUSED,
    ids=[f"{r[0]}->{r[2].split('.')[1]}@{r[1]}:{' '.join(r[3])}" for r in REFUSED],
)
def test_a_resume_that_changes_the_run_is_refused_in_one_line(
    tmp_path: Path, stopped, data_dir: Path, name, nproc, module, changed, words
):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped[name], run_dir)
    manifest = (run_dir / "manifest.json").read_text()
    flags = flags_of(module.split(".")[1] if module.endswith("cifar10") else name, data_dir)
    result = launch(nproc, module, "--run-dir", str(run_dir), *flags, *changed, "--resume")
    assert result.returncode == CONFIG_ERROR_EXIT_CODE, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == errors[0]  # nothing from torch after it
    assert "Traceback" not in result.stdout + result.stderr
    assert (run_dir / "manifest.json").read_text() == manifest  # the refused attempt is not recorded


def test_options_that_cannot_change_the_computation_may_differ_and_allow_config_change_continues(
    tmp_path: Path, stopped
):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped["toy-2"], run_dir)
    free = ("--log-every", "3", "--checkpoint-every", "5", "--keep-checkpoints", "3", "--dist-timeout-s", "60")
    result = launch(2, "experiments.toy", "--run-dir", str(run_dir), *TOY, *free, "--stop-at-step", "6", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    result = launch(
        2,
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        *TOY,
        "--steps",
        "16",
        "--lr",
        "0.1",
        "--resume",
        "--allow-config-change",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "--allow-config-change" in line]
    assert len(warnings) == 1 and "--steps: 12 -> 16, --lr: 0.2 -> 0.1" in warnings[0]  # rank 0's line only
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config_changes"] == ["--steps: 12 -> 16", "--lr: 0.2 -> 0.1"] and manifest["config"]["steps"] == 16
    assert [entry["config_changes"] for entry in manifest["history"][1:]] == [[]]  # the free change recorded none
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 16


def trained_indices(samples_dir: Path, batch_size: int) -> dict[int, list[int]]:
    """Per epoch, the indices every process trained on: what its sampler handed out, less an incomplete
    last batch (the loader drops it)."""
    per_epoch: dict[int, list[int]] = {}
    for record in samples_dir.glob("*.jsonl"):
        pulled: dict[int, list[int]] = {}
        for line in record.read_text().splitlines():
            epoch, index = json.loads(line)
            pulled.setdefault(epoch, []).append(index)
        for epoch, indices in pulled.items():
            per_epoch.setdefault(epoch, []).extend(indices[: len(indices) - len(indices) % batch_size])
    return per_epoch


def test_allow_config_change_continues_at_another_world_size_each_sample_once_per_epoch(tmp_path: Path):
    """4 processes stopped mid-epoch, continued at 3: the epoch's rest of the order is dealt to the 3 ranks
    (each sample at most once, fewer than one global batch left out by the cut), the run ends where the new
    world's --steps puts it, and one warning line says it is not bitwise."""
    run_dir, before, after = tmp_path / "run", tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    toy = ("--steps", "24", "--batch-size", "4", "--dataset-size", "96", "--log-every", "2")
    command = [prefork.python(), "-m", "ddp_core.torchrun", "--standalone"]
    recorder = ("-m", "tests.e2e.recording_sampler", "experiments.toy", "--run-dir", str(run_dir), *toy)
    stopped = run(
        [*command, "--nproc-per-node=4", *recorder, "--stop-at-step", "4"], timeout=300, SAMPLES_DIR=str(before)
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    refused = launch(3, "experiments.toy", "--run-dir", str(run_dir), *toy, "--resume")
    assert refused.returncode == CONFIG_ERROR_EXIT_CODE and "or pass --allow-config-change" in refused.stderr

    resumed = run(
        [*command, "--nproc-per-node=3", *recorder, "--resume", "--allow-config-change"],
        timeout=300,
        SAMPLES_DIR=str(after),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stdout.splitlines() if "not bitwise" in line]
    assert len(warnings) == 1, resumed.stdout[-3000:]
    assert (
        "written by 4 processes at step 4, with 3: epoch 1 continues after the 64 samples it trained on" in warnings[0]
    )
    # one account of the resume: no bitwise claim, no step that contradicts the warning's
    assert "is bitwise" not in resumed.stdout and " resumed " not in resumed.stdout
    assert (
        "step 8/24  epoch 1 " in resumed.stdout and "step 10/24  epoch 2 " in resumed.stdout
    )  # 64 + 2 x 12: the epoch's end
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config_changes"] == ["world size: 4 -> 3"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 24 and metrics["world_size"] == 3

    old, new = trained_indices(before, 4), trained_indices(after, 4)
    assert set(old) == {0} and len(old[0]) == 4 * 4 * 4  # 4 steps of 4 ranks x 4 samples
    epoch0 = old[0] + new[0]
    assert len(set(epoch0)) == len(epoch0)  # no sample twice in the epoch that changed world size
    assert 96 - len(epoch0) < 3 * 4  # left out: fewer than one global batch of the new world (the loader's cut)
    assert len(new[0]) == 2 * 3 * 4  # the 32 samples left, 11 per rank with padding, make 2 batches per rank
    for epoch in (1, 2):  # (24 - 6 - 2) steps / 8 per epoch at 3 processes: two whole epochs more, each sample once
        assert sorted(new[epoch]) == list(range(96))
    assert set(new) == {0, 1, 2}


def test_a_change_of_a_tensors_shape_is_refused_in_one_line_even_when_allowed(tmp_path: Path):
    """--allow-config-change accepts a change of --width, but the checkpoint's weights cannot fit the wider model:
    one line naming the tensor and the option, not torch's size-mismatch traceback."""
    run_dir = tmp_path / "run"
    tiny = ("--steps", "6", "--width", "16", "--heads", "2", "--layers", "1", "--block", "16", "--batch-size", "4")
    stopped = launch(
        2, "experiments.charlm", "--run-dir", str(run_dir), *tiny, "--warmup-steps", "1", "--stop-at-step", "2"
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    result = launch(
        2, "experiments.charlm", "--resume", "--run-dir", str(run_dir), "--width", "32", "--allow-config-change"
    )
    assert result.returncode == CONFIG_ERROR_EXIT_CODE, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert "model.token.weight is [27, 16], this run's [27, 32]: --width: 16 -> 32" in errors[0], errors[0]
    assert "(drop --width, or start a new run)" in errors[0] and "no checkpoint" not in result.stderr


def resumed_on_two_nodes(run_dir: Path, elsewhere: Path, *flags: str) -> tuple[list[int], str]:
    """``--resume`` of the toy by two agents on this machine as two nodes without shared storage: node 0's --run-dir
    is ``run_dir``, node 1's ``elsewhere``; each agent's exit code, and everything they said."""
    port, agents = free_port(), []
    try:
        for node_rank, folder in ((0, run_dir), (1, elsewhere)):
            nodes = ("--nnodes=2", f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}")
            argv = ("--resume", "--run-dir", str(folder), *flags)
            command = torchrun_command(1, "experiments.toy", *argv, torchrun_args=nodes, launcher="ddp_core.torchrun")
            agents.append(
                subprocess.Popen(
                    command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        said = "\n\n".join(agent.communicate(timeout=180)[0] for agent in agents)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return [agent.returncode for agent in agents], said


def test_a_node_without_the_run_directory_is_refused_rather_than_resuming_with_other_options(tmp_path: Path):
    """Node 0's --run-dir holds the run (stopped with --lr 0.5), node 1's is empty, so node 1 rebuilds its options
    from its command line (--lr 0.2). Rank 0 refuses in one line naming the option and the host, where before the
    ranks trained with different options until their collectives no longer matched."""
    run_dir = tmp_path / "run"
    stopped = launch(2, "experiments.toy", "--run-dir", str(run_dir), *TOY, "--lr", "0.5", "--stop-at-step", "3")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    manifest = (run_dir / "manifest.json").read_text()
    codes, said = resumed_on_two_nodes(run_dir, tmp_path / "node1" / "run")
    assert codes == [CONFIG_ERROR_EXIT_CODE] * 2, said[-5000:]
    errors = [line for line in said.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "rank 1 (host " in errors[0] and "--lr: 0.2 -> 0.5" in errors[0], said[-5000:]
    assert "Traceback" not in said and (run_dir / "manifest.json").read_text() == manifest


def test_a_finished_run_resumed_on_two_nodes_one_without_its_directory_ends_on_both(tmp_path: Path):
    """Node 0 holds the finished run, node 1 an empty --run-dir and the same flags: rank 0 says the run has finished,
    both nodes exit 0 and no file changes (node 0 alone leaving, as on one node, would leave node 1 waiting)."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "node1" / "run"
    finished = launch(2, "experiments.toy", "--run-dir", str(run_dir), *TOY)
    assert finished.returncode == 0 and (run_dir / "metrics.json").is_file(), finished.stderr[-3000:]
    before = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    codes, said = resumed_on_two_nodes(run_dir, elsewhere, *TOY)
    assert codes == [0, 0], said[-5000:]
    assert said.count("has finished") == 1 and "Traceback" not in said, said[-5000:]
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == before
    assert not elsewhere.exists()
