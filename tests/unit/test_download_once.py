"""--download: several processes at once download CIFAR10 exactly once, before any process
group exists, and a failed download reaches every one of them as the same single line.

Real processes (multiprocessing, forked from a fork server that imported this module, and with it torch, once)
call ``download_once`` together, released by one Barrier, with a stand-in ``fetch`` (no network here) that counts
its calls and writes a small dataset in the real format.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from ddp_core.errors import ConfigError
from experiments import cifar10_data
from experiments.cifar10_data import DOWNLOAD_FAILED, download_once, load_split

JOB = "run-1/0/127.0.0.1:29500"


def fetch_small_dataset(root: str | Path) -> None:
    calls = Path(root) / "calls"
    with open(calls, "a") as file:
        file.write(f"{os.getpid()}\n")
    inside = Path(root) / "inside"
    inside.touch(exist_ok=False)  # FileExistsError if two fetches ever overlapped
    train, test = cifar10_data.make_learnable_images(20, seed=0), cifar10_data.make_learnable_images(7, seed=1)
    cifar10_data.write_cifar10_format(root, train.images, train.labels, test.images, test.labels)
    inside.unlink()


def fetch_that_fails(root: str | Path) -> None:
    with open(Path(root) / "calls", "a") as file:
        file.write(f"{os.getpid()}\n")
    raise OSError("[Errno -3] Temporary failure in name resolution\n(while fetching the archive)")


def call_download_once(barrier, data_dir: str, fetch_name: str, job: str, out: str) -> None:
    barrier.wait()  # every process calls at the same moment
    try:
        download_once(data_dir, verify=False, fetch=globals()[fetch_name], job=job)
        outcome = {"ok": True, "test_images": len(load_split(data_dir, train=False, verify=False).labels)}
    except ConfigError as error:
        outcome = {"ok": False, "error": str(error)}
    Path(out).write_text(json.dumps(outcome))


def run_processes(data_dir: Path, fetch_name: str, n: int, tmp_path: Path) -> list[dict]:
    context = multiprocessing.get_context("forkserver")  # not spawn: each child would import torch again
    context.set_forkserver_preload([__name__])  # where this worker's fork server is not running yet
    barrier = context.Barrier(n)
    outs = [tmp_path / f"out{i}.json" for i in range(n)]
    processes = [
        context.Process(target=call_download_once, args=(barrier, str(data_dir), fetch_name, JOB, str(out)))
        for out in outs
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * n
    return [json.loads(out.read_text()) for out in outs]


def calls(data_dir: Path) -> int:
    path = data_dir / "calls"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("n", [2, 3])
def test_processes_at_once_download_exactly_once_and_all_find_the_data(tmp_path, n):
    data_dir = tmp_path / "data"
    outcomes = run_processes(data_dir, "fetch_small_dataset", n, tmp_path)
    assert outcomes == [{"ok": True, "test_images": 7}] * n
    assert calls(data_dir) == 1


def test_a_failed_download_reaches_every_process_as_one_line_after_one_attempt(tmp_path, n=3):
    data_dir = tmp_path / "data"
    outcomes = run_processes(data_dir, "fetch_that_fails", n, tmp_path)
    messages = {outcome["error"] for outcome in outcomes}
    assert len(messages) == 1 and not any(outcome["ok"] for outcome in outcomes)
    message = messages.pop()
    assert "\n" not in message and message.startswith(
        "--download failed (OSError: [Errno -3] Temporary failure in name resolution"
    )
    assert str(data_dir.resolve()) in message
    assert calls(data_dir) == 1  # the others read the failure instead of trying again, one after another


def test_data_already_there_is_not_downloaded_again(tmp_path):
    fetch_small_dataset(tmp_path)
    download_once(tmp_path, verify=False, fetch=fetch_that_fails, job=JOB)
    assert calls(tmp_path) == 1


def test_with_verify_files_that_are_not_the_official_ones_are_downloaded_again(tmp_path):
    fetch_small_dataset(tmp_path)  # synthetic: present, but not the official md5 sums
    download_once(tmp_path, verify=True, fetch=fetch_small_dataset, job=JOB)
    assert calls(tmp_path) == 2


@pytest.mark.parametrize(
    "failure",
    [
        {"job": JOB, "time": 0.0},  # this job id, but written before this process started
        {"job": "run-0/0/127.0.0.1:29500", "time": None},  # another job, just now
    ],
    ids=["earlier-relaunch", "other-job"],
)
def test_a_failure_left_by_another_launch_is_ignored_and_the_download_tried_again(tmp_path, failure):
    written = {
        **failure,
        "time": time.time() if failure["time"] is None else failure["time"],
        "message": "--download failed (old)",
    }
    (tmp_path / DOWNLOAD_FAILED).write_text(json.dumps(written))
    download_once(tmp_path, verify=False, fetch=fetch_small_dataset, job=JOB)
    assert calls(tmp_path) == 1
    assert not (tmp_path / DOWNLOAD_FAILED).exists()  # a success clears it


def test_a_world_of_one_never_reuses_a_failure(tmp_path):
    (tmp_path / DOWNLOAD_FAILED).write_text(
        json.dumps({"job": "", "time": time.time(), "message": "--download failed (old)"})
    )
    download_once(tmp_path, verify=False, fetch=fetch_small_dataset, job="")
    assert calls(tmp_path) == 1


def test_the_experiment_downloads_before_the_process_group_exists(monkeypatch, tmp_path):
    """No collective is running while the download does, so no DIST_TIMEOUT_S can expire during it."""
    import torch.distributed as dist

    from experiments import cifar10
    from tests.distributed.test_init_failures import LAUNCH_ENV

    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    group_existed = []

    def fetch(root: str | Path) -> None:
        group_existed.append(dist.is_initialized())
        fetch_small_dataset(root)

    monkeypatch.setattr(cifar10_data, "download", fetch)
    data_dir = tmp_path / "data"
    metrics = cifar10.main(
        [
            "--download",
            "--data-dir",
            str(data_dir),
            "--no-verify",
            "--model",
            "small",
            "--batch-size",
            "8",
            "--epochs",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert group_existed == [False] and metrics["eval_samples"] == 7
