"""A run directory that cannot be written, without a process group: the one-line message, and
each writer that reports it: TensorBoard (whose background thread keeps the error), metrics.json, the
manifest, and a checkpoint save that reports an earlier TensorBoard failure."""

from __future__ import annotations

import errno
import functools
import os
import threading
from pathlib import Path

import pytest
import torch

from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.group import DistContext
from ddp_core.exit_codes import STORAGE_EXIT_CODE
from ddp_core.output.logging import RankZeroWriter
from ddp_core.output.run import start_run
from ddp_core.output.storage import StorageError, describe, is_storage_error, os_error_in
from experiments.toy import ToyArgs, ToyModel


def os_error(number: int, filename: str | None = None) -> OSError:
    return OSError(number, os.strerror(number), *([filename] if filename else []))


def test_the_message_names_the_path_the_error_the_intact_checkpoint_and_the_fix(tmp_path):
    intact = "the last checkpoint, step 40, is intact: run/checkpoints/step_00000040.pt"
    full = describe(tmp_path / "x.pt", os_error(errno.ENOSPC), intact, needed_bytes=123_456_789)
    assert full.startswith(
        f"cannot write {tmp_path / 'x.pt'}: No space left on device (ENOSPC; it needs about 123.5 MB; "
    )
    assert f"; {intact}; free some space there" in full and full.endswith("then continue with --resume")
    assert "(EACCES); " in describe("f", os_error(errno.EACCES), intact) and "writable" in describe(
        "f", os_error(errno.EACCES), intact
    )
    assert "(EROFS); " in describe("f", os_error(errno.EROFS), intact) and "read-write" in describe(
        "f", os_error(errno.EROFS), intact
    )
    first = describe("f", os_error(errno.ENOSPC), None)
    assert "no checkpoint had been written yet" in first and first.endswith("then start the run again")
    assert StorageError.exit_code == STORAGE_EXIT_CODE == 74
    from ddp_core.torchrun import STATED_EXIT_CODES

    assert STORAGE_EXIT_CODE in STATED_EXIT_CODES  # python -m ddp_core.torchrun exits 74 too, without a failure summary


def test_storage_errors_and_the_one_torch_save_hides():
    assert is_storage_error(os_error(errno.ENOSPC)) and is_storage_error(PermissionError(errno.EACCES, "x"))
    assert not is_storage_error(os_error(errno.ENOTDIR)) and not is_storage_error(RuntimeError("x"))
    try:
        try:
            raise os_error(errno.ENOSPC)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")  # what torch.save raises
    except RuntimeError as error:
        assert os_error_in(error).errno == errno.ENOSPC


# ---- TensorBoard ----


@pytest.fixture
def disk_full_for_tensorboard(monkeypatch):
    """TensorBoard's local filesystem: every write and append fails with ENOSPC once switched on."""
    from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

    state = {"full": False}
    for name in ("write", "append"):
        original = getattr(LocalFileSystem, name)

        def failing(self, filename, *args, _original=original, **kwargs):
            if state["full"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _original(self, filename, *args, **kwargs)

        monkeypatch.setattr(LocalFileSystem, name, failing)
    return state


def test_a_failed_tensorboard_write_never_raises_mid_run_and_is_reported_at_close(
    tmp_path, disk_full_for_tensorboard, capfd
):
    writer = RankZeroWriter(tmp_path, enabled=True)
    writer.add_scalar("train/loss", 1.0, 1)
    assert writer.poll() is None
    disk_full_for_tensorboard["full"] = True
    for step in range(2, 50):  # the background thread fails; the next calls must not raise
        writer.add_scalar("train/loss", 1.0 / step, step)
    writer.add_text("notes", "text", 50)
    writer.add_hparams({"lr": 0.1}, {"hparam/final_loss": 0.5}, 50)
    path, error = writer.poll()
    assert (
        error.errno == errno.ENOSPC
        and Path(path).name.startswith("events.out.tfevents.")
        and Path(path).parent == tmp_path
    )
    with pytest.raises(StorageError) as raised:
        writer.close()
    message = str(raised.value)
    assert message.startswith(f"cannot write {path}: No space left on device (ENOSPC") and "\n" not in message
    writer.close()  # once only: a second close (an exit path) does not raise again
    assert "Traceback" not in capfd.readouterr().err  # the thread's exception was not printed


def test_the_thread_hook_silences_tensorboards_write_errors_only(monkeypatch):
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from ddp_core.output import logging as ddp_logging

    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append((type(args.thread).__name__, args.exc_type)))
    fresh = functools.cache(ddp_logging._quiet_tensorboard_thread_errors.__wrapped__)  # not yet installed
    monkeypatch.setattr(ddp_logging, "_quiet_tensorboard_thread_errors", fresh)
    ddp_logging._quiet_tensorboard_thread_errors()  # chains to the hook before it (the recorder above)

    class FakeWriterThread(_AsyncWriterThread):
        def __init__(self, error: BaseException) -> None:
            threading.Thread.__init__(self, daemon=True)
            self.error = error

        def run(self) -> None:
            raise self.error

    class Other(threading.Thread):
        def run(self) -> None:
            raise OSError(errno.ENOSPC, "not TensorBoard's")

    for thread in (FakeWriterThread(OSError(errno.ENOSPC, "full")), FakeWriterThread(ValueError("a bug")), Other()):
        thread.start()
        thread.join()
    assert seen == [("FakeWriterThread", ValueError), ("Other", OSError)]


# ---- the run: metrics.json, manifest.json, TensorBoard at the next checkpoint ----


def start(tmp_path: Path, **args):
    ctx = DistContext(env=DistEnv(), backend="gloo", device=torch.device("cpu"))
    return start_run("toy", ToyArgs(run_dir=str(tmp_path / "run"), **args), ctx)


def refuse_writes(monkeypatch, number: int) -> None:
    """What atomic_write opens (the manifest, metrics.json, checkpoints) now fails."""
    import builtins

    def fake_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            raise OSError(number, os.strerror(number), str(file))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr("ddp_core.output.checkpoint.open", fake_open, raising=False)


def test_metrics_json_that_cannot_be_written_is_one_line_naming_it_and_the_checkpoint(tmp_path, monkeypatch):
    run = start(tmp_path)
    run.save_checkpoint(40, lambda: {"model": ToyModel().state_dict()})
    run.checkpoints.wait()  # on disk (written in the background) before the disk refuses
    refuse_writes(monkeypatch, errno.EACCES)
    with pytest.raises(StorageError) as raised:
        run.finish({"steps": 40})
    message = str(raised.value)
    assert message.startswith(f"cannot write {run.dir / 'metrics.json'}: Permission denied (EACCES); ")
    assert f"the last checkpoint, step 40, is intact: {run.dir / 'checkpoints' / 'step_00000040.pt'}" in message
    assert not (run.dir / "metrics.json").exists() and not list(run.dir.glob(".*tmp-*"))


def test_a_manifest_that_cannot_be_written_stops_the_run_before_it_starts(tmp_path, monkeypatch):
    refuse_writes(monkeypatch, errno.EROFS)
    with pytest.raises(StorageError) as raised:
        start(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"cannot write {tmp_path / 'run' / 'manifest.json'}: Read-only file system (EROFS); ")
    assert "no checkpoint had been written yet" in message


def test_a_tensorboard_failure_stops_the_run_at_the_next_checkpoint_which_is_written(
    tmp_path, disk_full_for_tensorboard
):
    run = start(tmp_path)
    writer = run.open_writer()
    writer.add_scalar("train/loss", 1.0, 1)
    run.save_checkpoint(10, lambda: {"model": ToyModel().state_dict()})
    disk_full_for_tensorboard["full"] = True
    writer.add_scalar("train/loss", 0.5, 20)
    with pytest.raises(StorageError) as raised:
        run.save_checkpoint(20, lambda: {"model": ToyModel().state_dict()})
    message = str(raised.value)
    assert message.startswith("cannot write ") and "events.out.tfevents." in message and "(ENOSPC" in message
    assert f"the last checkpoint, step 20, is intact: {run.dir / 'checkpoints' / 'step_00000020.pt'}" in message
    assert torch.load(run.checkpoint_path, weights_only=True)["step"] == 20
