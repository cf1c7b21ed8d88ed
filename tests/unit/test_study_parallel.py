"""``python -m tools.study --parallel N`` without training: the scheduler runs stand-in runs (bash scripts that
write what a run leaves in its directory), so who runs when, with which devices, is seen exactly.

Each stand-in logs its CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS, marks that it started, and waits for the test
to release it (or for SIGTERM, answered as a run does: exit 143 with its checkpoint's status). The GPU counts
are torch.cuda.device_count monkeypatched. The real runs side by side: tests/e2e/test_study.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from ddp_core.errors import ConfigError
from tools.study import Combination, Study, Task, main
from tools.study.local import run_local, slots

# A stand-in run: $1 its directory, $2 what it does once released (ok, fail, diverge).
RUN = r"""
run=$1; mkdir -p "$run"
echo "devices=${CUDA_VISIBLE_DEVICES-unset} threads=${OMP_NUM_THREADS-unset}"
trap 'echo "{\"exit_code\": 143}" > "$run/manifest.json"; echo "stopped by a signal after step 3"; exit 143' TERM
touch "$run/started"
while [[ ! -e "$run/release" ]]; do sleep 0.01 & wait $!; done
case $2 in
  ok) echo '{"exit_code": 0}' > "$run/manifest.json"; echo '{"final_loss": 0.5}' > "$run/metrics.json"; exit 0;;
  fail) echo "Traceback ..."; echo "error: rank 0 raised RuntimeError: injected"; exit 1;;
  diverge) echo '{"exit_code": 3}' > "$run/manifest.json"; echo "error: the loss is nan at step 4"; exit 3;;
esac
"""


def _study(tmp_path: Path, modes: list[str]) -> tuple[Study, list[Task], dict[str, str]]:
    study = Study("toy", "fake", tmp_path / "fake", len(modes), {}, 1, [], "local")
    (study.dir / "logs").mkdir(parents=True)
    study.tasks = [
        Task(Combination(()), seed, study.dir / f"seed-{seed}", study.dir / "logs" / f"seed-{seed}.log", None)
        for seed in range(len(modes))
    ]
    return study, study.tasks, {str(task.run_dir): mode for task, mode in zip(study.tasks, modes)}


def _command(modes: dict[str, str]):
    return lambda study, task: ["bash", "-c", RUN, "run", str(task.run_dir), modes[str(task.run_dir)]]


def _wait(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.01)  # polling files; the condition decides


def _started(tasks: list[Task]) -> list[int]:
    return [task.seed for task in tasks if (task.run_dir / "started").exists()]


@pytest.fixture
def own_signals():
    """run_local installs its SIGTERM and SIGINT handlers: pytest's are put back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def _in_thread(steps) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            steps()
        except BaseException as error:  # reported by the test's main thread
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_at_most_n_at_once_each_in_a_slot_of_its_own_and_a_freed_slot_is_reused(tmp_path, own_signals):
    study, tasks, modes = _study(tmp_path, ["ok"] * 4)
    resources = [{"CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    seen: dict[str, list[int]] = {}

    def steps() -> None:
        _wait(lambda: _started(tasks) == [0, 1], "the first two runs")
        seen["first"] = _started(tasks)  # none has ended: no third can have started
        (tasks[1].run_dir / "release").touch()
        _wait(lambda: 2 in _started(tasks), "the third run")
        seen["second"] = _started(tasks)
        for task in tasks:
            task.run_dir.mkdir(exist_ok=True)
            (task.run_dir / "release").touch()

    thread, errors = _in_thread(steps)
    endings = run_local(study, tasks, resources, _command(modes))
    thread.join()
    assert not errors, errors
    assert endings == [] and [task.state for task in tasks] == ["finished"] * 4
    # run 0 was never released and run 1's slot went to run 2: run 3 waited
    assert seen == {"first": [0, 1], "second": [0, 1, 2]}, seen
    first_lines = [task.log.read_text().splitlines()[0] for task in tasks]
    assert first_lines[0] == "devices=0,1 threads=1" and first_lines[1] == "devices=2,3 threads=unset"
    assert first_lines[2] == first_lines[1]  # the slot run 1 freed


def test_a_failed_and_a_diverged_run_do_not_stop_the_others_and_are_listed_with_code_and_why(tmp_path, own_signals):
    study, tasks, modes = _study(tmp_path, ["fail", "diverge", "ok"])
    for task in tasks:
        task.run_dir.mkdir()
        (task.run_dir / "release").touch()
    endings = run_local(study, tasks, [{}, {}], _command(modes))
    assert [task.state for task in tasks] == ["failed", "diverged", "finished"]
    assert [(e.label, e.state, e.code, e.why) for e in endings] == [
        ("base seed 0", "failed", 1, "error: rank 0 raised RuntimeError: injected"),
        ("base seed 1", "diverged", 3, "error: the loss is nan at step 4"),
    ]
    assert endings[0].line().startswith("base seed 0: failed (exit 1): error: rank 0 raised")


def test_sigterm_stops_every_running_run_with_its_checkpoint_and_starts_no_other(tmp_path, own_signals):
    study, tasks, modes = _study(tmp_path, ["ok"] * 3)

    def steps() -> None:
        _wait(lambda: _started(tasks) == [0, 1], "the first two runs")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    thread, errors = _in_thread(steps)
    with pytest.raises(SystemExit) as stopped:
        run_local(study, tasks, [{}, {}], _command(modes))
    thread.join()
    assert not errors, errors
    assert stopped.value.code == 143
    assert [task.state for task in tasks] == ["stopped", "stopped", "new"]  # both told, the third never started
    assert not tasks[2].run_dir.exists()
    for task in tasks[:2]:
        assert json.loads((task.run_dir / "manifest.json").read_text()) == {"exit_code": 143}


def _gpus(monkeypatch, count: int) -> None:
    """This machine has ``count`` GPUs, all visible."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    ("count", "environ", "parallel", "nproc", "per_run", "expected"),
    [
        (4, {}, 2, 2, None, ["0,1", "2,3"]),
        (4, {"CUDA_VISIBLE_DEVICES": "3,5,6,7"}, 4, 1, None, ["3", "5", "6", "7"]),
        (8, {}, 2, 1, 3, ["0,1,2", "3,4,5"]),
        (2, {}, 2, 1, 0, ["", ""]),  # CPU runs on a GPU machine: no GPU for either
        (0, {}, 3, 2, None, [None, None, None]),  # CPU machine: nothing to hide
    ],
    ids=["nproc", "visible-devices", "more-than-nproc", "cpu-on-gpus", "cpu"],
)
def test_each_run_gets_gpus_of_its_own_and_one_thread(monkeypatch, count, environ, parallel, nproc, per_run, expected):
    _gpus(monkeypatch, count)
    given = slots(parallel, nproc, per_run, environ)
    assert [slot.get("CUDA_VISIBLE_DEVICES") for slot in given] == expected
    assert all(slot["OMP_NUM_THREADS"] == "1" for slot in given)
    assert "OMP_NUM_THREADS" not in slots(parallel, nproc, per_run, {**environ, "OMP_NUM_THREADS": "4"})[0]


@pytest.mark.parametrize(
    ("count", "parallel", "nproc", "per_run", "says"),
    [
        (4, 3, 2, None, "--parallel 3 runs x 2 GPU(s) needs 6 GPUs, this machine has 4: --parallel 2 at most"),
        (4, 1, 1, 5, "--gpus-per-run 5: this machine has 4 GPU(s) visible"),
        (2, 1, 4, None, "--nproc 4 (one GPU each): this machine has 2 GPU(s) visible"),
        (4, 1, 2, 1, "--gpus-per-run 1 is fewer than --nproc 2"),
        (0, 1, 1, 1, "--gpus-per-run 1: this machine has 0 GPU(s) visible"),
        (0, 1, 1, -1, "--gpus-per-run -1: 0 (CPU) or more"),
    ],
)
def test_impossible_resources_are_refused(monkeypatch, count, parallel, nproc, per_run, says):
    _gpus(monkeypatch, count)
    with pytest.raises(ConfigError) as refused:
        slots(parallel, nproc, per_run, {})
    assert str(refused.value).startswith(says), str(refused.value)


@pytest.mark.parametrize(
    ("extra", "gpus", "says"),
    [
        (["--parallel", "0"], 0, "error: --parallel 0: at least 1 run at a time"),
        (["--gpus-per-run", "2"], 1, "error: --gpus-per-run 2: this machine has 1 GPU(s) visible"),
        (["--parallel", "2", "--gpus-per-run", "1"], 1, "error: --parallel 2 runs x 1 GPU(s) needs 2 GPUs"),
        (["--apply"], 0, "error: --apply is for --launcher k8s"),
    ],
    ids=["parallel-0", "gpus", "parallel-gpus", "apply"],
)
def test_bad_values_are_one_line_exit_2_before_anything_is_written(
    monkeypatch, tmp_path, capsys, clean_env, extra, gpus, says
):
    _gpus(monkeypatch, gpus)
    argv = ["toy", "--seeds", "2", "--grid", "lr=0.1,0.2", "--nproc", "1", "--runs-dir", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as refused:
        main([*argv, *extra, "--", "--steps", "5"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith(says) and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()
