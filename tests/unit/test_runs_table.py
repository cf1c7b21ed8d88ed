"""ddp_core.runs: the table of runs and --compare, read from run directories built on disk as real runs
write them (the shapes of manifest.json and metrics.json copied from a toy run), and one real toy run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core import runs as runs_module
from ddp_core.output import process_identity
from ddp_core.runs import find_runs, main, read_run
from tests import prefork
from tests.e2e.launch import clean_env

REPO = Path(__file__).resolve().parents[2]


def manifest(
    experiment="toy",
    start="2026-11-23T10:46:20.701258+00:00",
    world_size=1,
    backend="gloo",
    nodes=1,
    seed=0,
    commit="fdb8c2712f618c977dabfd53253294bf1da0b1ec",
    dirty=True,
    run_dir="/elsewhere/runs/toy/a",
    **config,
):
    """A manifest.json as experiments.toy writes it (start_run in ddp_core/output/run.py)."""
    return {
        "command": ["/work/main/experiments/toy.py", "--steps", "20", "--run-dir", run_dir],
        "config": {
            "backend": "auto",
            "batch_size": 32,
            "checkpoint_every": 50,
            "dataset_size": 4096,
            "deterministic": False,
            "dist_timeout_s": 300.0,
            "init_method": "env://",
            "keep_checkpoints": 2,
            "log_every": 20,
            "lr": 0.2,
            "nproc": 1,
            "resume": False,
            "resume_from": "",
            "run_dir": run_dir,
            "seed": seed,
            "steps": 20,
            **config,
        },
        "devices": ["cpu"] * world_size,
        "experiment": experiment,
        "git": {"commit": commit, "dirty": dirty},
        "gpus": [],
        "hosts": ["vm"],
        "resumed": False,
        "seed": seed,
        "start_time": start,
        "torchelastic_run_id": None,
        "versions": {
            "cuda": "13.0",
            "cudnn": None,
            "driver": None,
            "nccl": None,
            "python": "3.11.7",
            "torch": "2.14.1+cu130",
            "torchvision": "0.29.1",
        },
        "world": {
            "attempt": 1,
            "backend": backend,
            "device": "cpu",
            "nodes": nodes,
            "processes_per_node": world_size // nodes,
            "restart_count": 0,
            "world_size": world_size,
        },
    }


TOY_METRICS = {
    "final_loss": 0.2999096676707268,
    "global_batch_size": 32,
    "samples_per_s": 11080.607314959969,
    "steps": 20,
    "stopped_early": False,
    "wall_time_s": 1.925744,
    "world_size": 1,
}
CIFAR_METRICS = {
    "eval_accuracy": 0.8123,
    "eval_loss": 0.61,
    "eval_samples": 10000,
    "images_per_s": 25000.5,
    "steps": 390,
    "per_class_accuracy": {"cat": 0.6},
    "amp": "bf16",
    "wall_time_s": 125.0,
}


def make_run(
    root: Path, name: str, manifest_data=None, metrics=None, steps=(), raw_manifest: str | None = None
) -> Path:
    folder = root / name
    (folder / "checkpoints").mkdir(parents=True)
    if manifest_data is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest_data, indent=2, sort_keys=True) + "\n")
    if raw_manifest is not None:
        (folder / "manifest.json").write_text(raw_manifest)
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    for step in steps:
        (folder / "checkpoints" / f"step_{step:08d}.pt").write_bytes(b"not a real checkpoint: never opened")
    if steps:
        shutil.copy(folder / "checkpoints" / f"step_{max(steps):08d}.pt", folder / "checkpoints" / "last.pt")
    return folder


def table_of(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / "runs"
    make_run(root, "toy/20261123T104620Z", manifest(), TOY_METRICS, steps=[20])
    make_run(
        root,
        "toy/stopped",
        manifest(start="2026-11-23T11:00:00+00:00"),
        {**TOY_METRICS, "stopped_early": True, "steps": 7},
        steps=[7],
    )
    make_run(
        root,
        "cifar10/incomplete",
        manifest(
            "cifar10", start="2026-11-23T12:00:00+00:00", world_size=4, backend="nccl", nodes=2, seed=3, dirty=False
        ),
        None,
        steps=[100, 200],
    )
    make_run(
        root,
        "cifar10/done",
        manifest("cifar10", start="2026-11-22T09:00:00+00:00", world_size=2, backend="nccl"),
        CIFAR_METRICS,
        steps=[390],
    )
    make_run(root, "toy/diverged", manifest(start="2026-11-21T08:00:00+00:00") | {"exit_code": 3}, None, steps=[40])
    make_run(root, "toy/marked", manifest(start="2026-11-20T08:00:00+00:00") | {"status": "running"}, None)
    return root


def test_each_status_and_the_columns(runs_dir, capsys):
    table = rows(table_of(capsys, str(runs_dir)))
    expected = {
        "toy/20261123T104620Z": [
            "toy",
            "2026-11-23 10:46:20",
            "finished",
            "1 gloo",
            "fdb8c27-dirty",
            "20",
            "1.9s",
            "final_loss=0.2999",
            "samples_per_s=11081",
        ],
        "toy/stopped": ["stopped", "7"],
        "cifar10/incomplete": ["cifar10", "incomplete", "4 nccl (2 nodes)", "fdb8c27 ", "200"],
        "cifar10/done": [
            "finished",
            "2 nccl",
            "390",
            "2m05s",
            "eval_accuracy=0.8123",
            "eval_loss=0.61",
            "images_per_s=25000",
        ],
        "toy/diverged": ["diverged", "40"],
        "toy/marked": ["running"],
    }
    assert set(table) == set(expected)
    for name, pieces in expected.items():
        for piece in pieces:
            assert piece in table[name], (name, piece, table[name])
    assert "-dirty" not in table["cifar10/incomplete"]
    assert "per_class_accuracy" not in table["cifar10/done"]  # headline metrics: numbers only, a few


def test_newest_first_and_aligned(runs_dir, capsys):
    out = table_of(capsys, str(runs_dir))
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [
        "cifar10/incomplete",
        "toy/stopped",
        "toy/20261123T104620Z",
        "cifar10/done",
        "toy/diverged",
        "toy/marked",
    ]
    column = lines[0].index("status")
    assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines[1:])  # one column, aligned


def test_start_time_from_the_first_launch_and_launch_count(tmp_path, capsys):
    first = manifest(start="2026-01-01T00:00:00+00:00")
    resumed = manifest(start="2026-06-01T00:00:00+00:00") | {"resumed": True, "history": [first]}
    make_run(tmp_path, "toy/resumed", resumed, TOY_METRICS, steps=[20])
    line = rows(table_of(capsys, str(tmp_path)))["toy/resumed"]
    assert "2026-01-01 00:00:00" in line and "finished (2 launches)" in line


def test_missing_and_broken_files_are_tolerated(tmp_path, capsys):
    make_run(tmp_path, "toy/20261101T010203Z", None, TOY_METRICS)  # metrics only: start time from the folder's name
    make_run(tmp_path, "toy/broken", None, None, steps=[5], raw_manifest="{not json")
    make_run(tmp_path, "odd/empty-manifest", {}, None)
    out = table_of(capsys, str(tmp_path))
    table = rows(out)
    assert "2026-11-01 01:02:03" in table["toy/20261101T010203Z"] and "finished" in table["toy/20261101T010203Z"]
    assert "incomplete" in table["toy/broken"] and " 5 " in table["toy/broken"]
    assert "odd" in table["odd/empty-manifest"]  # the experiment from the folder's parent
    assert "unreadable files" in out and "toy/broken: manifest.json" in out


def test_headline_metrics_of_an_unknown_experiment():
    metrics = {
        "rows": [{"op": "all_reduce"}],
        "world_size": 2,
        "all_ok": True,
        "wrong": 0,
        "warmup": 5,
        "iters": 20,
        "peak_busbw_GBps": {"all_reduce": 1.0},
        "wall_time_s": 3.0,
        "steps": 1,
    }
    assert runs_module.headline_metrics(metrics) == {"wrong": 0}
    assert list(runs_module.headline_metrics(CIFAR_METRICS)) == ["eval_accuracy", "eval_loss", "images_per_s"]


def test_a_copied_runs_folder_reads_the_same(runs_dir, tmp_path, capsys, monkeypatch):
    before = table_of(capsys, str(runs_dir))
    moved = tmp_path / "elsewhere" / "copied"
    shutil.copytree(runs_dir, moved)
    shutil.rmtree(runs_dir)
    assert table_of(capsys, str(moved)) == before
    monkeypatch.chdir(moved.parent)
    assert table_of(capsys, "copied") == before  # a relative RUNS_DIR too


def test_json(runs_dir, capsys):
    data = json.loads(table_of(capsys, str(runs_dir), "--json"))
    by_name = {row["name"]: row for row in data}
    assert by_name["toy/stopped"]["status"] == "stopped" and by_name["toy/stopped"]["step"] == 7
    assert by_name["cifar10/done"]["headline"]["eval_accuracy"] == 0.8123
    assert by_name["toy/20261123T104620Z"]["code"] == "fdb8c27-dirty"


def test_compare_shows_config_setup_and_metric_differences(tmp_path, capsys):
    make_run(tmp_path, "toy/a", manifest(), TOY_METRICS, steps=[20])
    make_run(
        tmp_path,
        "toy/b",
        manifest(lr=0.5, steps=10, seed=1, commit="6597418aaaa", run_dir="/x/toy/b"),
        {**TOY_METRICS, "final_loss": 0.28, "steps": 10},
        steps=[10],
    )
    out = table_of(capsys, str(tmp_path), "--compare", "toy/a", str(tmp_path / "toy" / "b"))
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["lr"] == ["lr", "0.2", "0.5"] and lines["steps"][1:3] == ["20", "10"]
    assert lines["seed"][1:] == ["0", "1"] and lines["code"][1:] == ["fdb8c27-dirty", "6597418-dirty"]
    assert lines["final_loss"][1:] == ["0.2999", "0.28", "-6.6%"]
    assert "batch_size" not in lines and "run_dir" not in lines  # config: only what differs
    assert lines["samples_per_s"][1:] == ["11081", "11081", "same"]  # metrics: the equal ones too
    assert "A: toy/a" in out and "B: toy/b" in out


def test_compare_of_a_run_without_metrics(tmp_path, capsys):
    make_run(tmp_path, "toy/a", manifest(), None, steps=[3])
    make_run(tmp_path, "toy/b", manifest(), None, steps=[3])
    out = table_of(capsys, "--compare", str(tmp_path / "toy/a"), str(tmp_path / "toy/b"))
    assert "config: the same" in out and "neither run wrote metrics.json" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{root}/missing"], "runs directory {root}/missing does not exist"),
        (["{root}/file.txt"], "is not a directory"),
        (["{root}", "--compare", "toy", "toy/a"], "--compare toy: not a run directory"),
        (["{root}", "--compare", "toy/a", "toy/nope"], "--compare toy/nope: no such run"),
        (["{root}", "--compare", "toy/a"], "expected 2 arguments"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    make_run(tmp_path, "toy/a", manifest(), TOY_METRICS)
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(SystemExit) as stop:
        main([arg.format(root=tmp_path) for arg in argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(root=tmp_path) in err


def test_an_empty_runs_folder(tmp_path, capsys):
    assert table_of(capsys, str(tmp_path)).strip() == f"no runs under {tmp_path}"


def test_never_imports_torch():
    code = "import sys, ddp_core.runs; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_a_real_toy_run(tmp_path):
    env = clean_env()  # no launch or ddp-lab variable of the test runner's
    run_dir = tmp_path / "runs" / "toy" / "real"
    subprocess.run(  # forked from the suite's server, torch imported already (tests/prefork.py)
        [prefork.python(), "-m", "experiments.toy", "--steps", "10", "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    info = read_run(run_dir, "toy/real")
    assert info.manifest["exit_code"] == 0  # recorded by rank 0 as it left
    assert (info.experiment, info.status, info.world_size, info.backend, info.seed, info.step) == (
        "toy",
        "finished",
        1,
        "gloo",
        0,
        10,
    )
    assert info.wall_time_s and info.wall_time_s > 0 and info.started is not None
    assert set(info.headline) == {"final_loss", "samples_per_s"}
    assert [run.name for run in find_runs(tmp_path / "runs")] == ["toy/real"]
    out = subprocess.run(
        [sys.executable, "-m", "ddp_core.runs", str(tmp_path / "runs")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    header, row = out.splitlines()
    assert (
        header.split()[:3] == ["run", "experiment", "started"]
        and row.split()[:2] == ["toy/real", "toy"]
        and "finished" in row
    )


def test_a_run_without_an_exit_code_is_running_failed_or_incomplete_by_its_rank0_process(tmp_path):
    """No exit code recorded: alive on this host is running; gone from it (killed) is failed, and so is a process
    that exited but was never collected by its parent (a zombie: a killed study's runs, under a PID 1 that reaps
    late or never); another host's cannot be told (incomplete); a pid reused by a later process is not the run's."""
    finished_process = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(finished_process.stdout)
    me = process_identity.this_process()
    unreaped = subprocess.Popen(["true"])  # exited, not yet waited for: a zombie, as a killed study leaves its runs
    while process_identity.stat_fields(unreaped.pid)[0] != "Z":
        time.sleep(0.01)  # polling its state: the condition decides
    zombie = {**me, "pid": unreaped.pid, "pid_start": process_identity.start_time(unreaped.pid)}
    cases = {
        "alive": me,
        "killed": {**me, "pid": dead_pid},
        "exited, not collected": zombie,
        "elsewhere": {**me, "host": me["host"] + "-other"},
        "reused": {**me, "pid_start": "1"},
        "older": None,  # written before ddp-lab recorded the process
    }
    for name, process in cases.items():
        record = manifest() | ({"rank0_process": process} if process else {})
        make_run(tmp_path, f"toy/{name}", record, None, steps=[5])
    status = {name: read_run(tmp_path / "toy" / name, name).status for name in cases}
    unreaped.wait()
    assert status == {
        "alive": "running",
        "killed": "failed",
        "exited, not collected": "failed",
        "elsewhere": "incomplete",
        "reused": "failed",
        "older": "incomplete",
    }


@pytest.mark.parametrize(
    "kill_says, stat_readable, alive",
    [
        (None, True, True),  # here, its start time matches
        (None, False, False),  # here for kill, gone for /proc: it ended between the two looks (bench.pid_reuse)
        (PermissionError, False, True),  # another user's, its /proc entry hidden (hidepid): alive as far as we know
        (ProcessLookupError, True, False),
    ],
)
def test_a_process_that_ends_between_the_two_looks_is_gone(monkeypatch, kill_says, stat_readable, alive):
    """A killed run's pid, held for a moment by a later process: kill(pid, 0) found it, then /proc had nothing."""
    me = process_identity.this_process()
    fields = process_identity.stat_fields(me["pid"])

    def kill(pid: int, signal_number: int) -> None:
        assert (pid, signal_number) == (me["pid"], 0)
        if kill_says is not None:
            raise kill_says()

    monkeypatch.setattr(process_identity.os, "kill", kill)
    monkeypatch.setattr(process_identity, "stat_fields", lambda pid: fields if stat_readable else [])
    assert process_identity.alive_here(me) is alive


def test_the_recorded_exit_code_decides_the_status(tmp_path):
    cases = {  # name: (exit code, metrics.json)
        "done": (0, {"final_loss": 0.1}),
        "stop_at_step": (0, None),
        "signal": (143, None),
        "toy_signal": (143, {"stopped_early": True}),
        "diverged": (3, None),
        "disk_full": (74, None),
        "traceback": (1, None),
        "bad_config": (2, None),
    }
    for name, (code, metrics) in cases.items():
        make_run(tmp_path, f"toy/{name}", manifest() | {"exit_code": code}, metrics, steps=[5])
    status = {name: read_run(tmp_path / "toy" / name, name).status for name in cases}
    assert status == {
        "done": "finished",
        "stop_at_step": "stopped",
        "signal": "stopped",
        "toy_signal": "stopped",
        "diverged": "diverged",
        "disk_full": "failed",
        "traceback": "failed",
        "bad_config": "failed",
    }
