"""Checkpoints written in the background (ddp_core/output/background_write.py): what the loop hands over is a copy,
one write is in flight at a time, a failed write stops the next save, and a kill inside the write leaves the
previous checkpoint whole."""

from __future__ import annotations

import errno
import io
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import ddp_core.output.checkpoint as checkpoint_module
from ddp_core.output.background_write import WRITES
from ddp_core.output.checkpoint import CheckpointDir, load_checkpoint
from ddp_core.output.storage import StorageError
from ddp_core.training.transfer import to_host


def states(scale: float = 1.0, size: int = 1000) -> dict:
    model = torch.nn.Linear(size, 2)
    with torch.no_grad():
        model.weight.fill_(scale)
    return {"model": model.state_dict(), "rng": [{"python": (3, tuple(range(5)), None), "torch": torch.ones(3)}]}


def test_the_copy_is_the_states_own_and_keeps_their_shape():
    original = states()
    copied = to_host(original)
    original["model"]["weight"].add_(1)  # training goes on after the save
    original["rng"][0]["torch"].zero_()
    assert torch.equal(copied["model"]["weight"], torch.ones(2, 1000))
    assert torch.equal(copied["rng"][0]["torch"], torch.ones(3))
    assert copied["model"]._metadata == original["model"]._metadata  # module versions, for load_state_dict
    assert copied["rng"][0]["python"] == (3, tuple(range(5)), None)
    assert list(copied["model"]) == list(original["model"])


def test_a_background_save_returns_before_its_write_and_the_next_one_waits_for_it(tmp_path: Path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    write = CheckpointDir.write

    def held_write(self, path, state):
        entered.set()
        release.wait()  # the test decides when the disk is done
        write(self, path, state)

    monkeypatch.setattr(CheckpointDir, "write", held_write)
    directory = CheckpointDir(tmp_path / "checkpoints", keep=2, background=True)
    live = states(1.0)
    directory.save(1, lambda: live)
    assert entered.wait(timeout=60) and WRITES.in_flight  # save returned with its write in flight
    live["model"]["weight"].fill_(7.0)  # the next steps change the model, not what is being written
    assert not directory.path_for(1).exists()
    second = threading.Thread(target=directory.save, args=(2, lambda: states(2.0)))
    second.start()
    assert second.is_alive()  # waits for the first write
    release.set()
    second.join(timeout=60)
    directory.wait()
    assert not second.is_alive()
    assert torch.equal(load_checkpoint(directory.path_for(1))["model"]["weight"], torch.ones(2, 1000))
    assert load_checkpoint(directory.last)["step"] == 2
    directory.save(3, lambda: states(3.0))
    directory.wait()
    assert [step for step, _ in directory.complete()] == [3, 2]  # keep-K, once each write is complete


def test_a_failed_background_write_stops_the_next_save_naming_the_intact_checkpoint(tmp_path: Path, monkeypatch):
    directory = CheckpointDir(tmp_path / "checkpoints", keep=2, background=True)
    directory.save(1, lambda: states())
    directory.wait()
    atomic_write = checkpoint_module.atomic_write

    def full_disk(path, write):
        if Path(path).name.startswith("step_"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        atomic_write(path, write)

    monkeypatch.setattr(checkpoint_module, "atomic_write", full_disk)
    directory.save(2, lambda: states())  # fails in the background
    with pytest.raises(StorageError, match=r"cannot write .*step_00000002\.pt.*ENOSPC.*step 1, is intact"):
        directory.save(3, lambda: states())
    assert load_checkpoint(directory.last)["step"] == 1 and not directory.path_for(3).exists()


# Below torch's grain size (32768 elements): the forked child never enters an OpenMP parallel region, which hangs
# in a child forked from a process whose OpenMP threads ran before (a pytest worker that ran other modules).
SMALL = 4_000


def test_a_kill_inside_the_background_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path):
    """A forked process saves step 1, then starts step 2 and is SIGKILLed halfway through writing its file (it says
    so through a pipe, and waits): step 1 still loads, last.pt names it, and the next save removes the leftover."""
    directory = CheckpointDir(tmp_path / "checkpoints", keep=2, background=True)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank that is killed
        try:
            os.close(reader)
            directory.save(1, lambda: states(1.0, size=SMALL))
            directory.wait()
            save = torch.save

            def half_then_wait(obj, f, *args, **kwargs):
                buffer = io.BytesIO()
                save(obj, buffer, *args, **kwargs)
                f.write(buffer.getvalue()[: buffer.tell() // 2])
                f.flush()
                os.write(writer, b"x")  # halfway: the parent kills this process now
                threading.Event().wait()

            torch.save = half_then_wait
            directory.save(2, lambda: states(2.0, size=SMALL))
            threading.Event().wait()
        finally:
            os._exit(1)
    os.close(writer)
    try:
        assert os.read(reader, 1) == b"x"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(reader)
    [leftover] = directory.dir.glob(".step_00000002.pt.tmp-*")
    assert leftover.stat().st_size > 0
    assert load_checkpoint(directory.last)["step"] == 1
    assert torch.equal(load_checkpoint(directory.path_for(1))["model"]["weight"], torch.ones(2, SMALL))
    directory.save(3, lambda: states(3.0))
    directory.wait()
    assert not list(directory.dir.glob(".*.tmp-*")) and load_checkpoint(directory.last)["step"] == 3
