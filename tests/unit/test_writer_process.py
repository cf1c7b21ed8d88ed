"""The checkpoint writer process: a state crosses over in shared memory exactly, the file is the one a thread writes,
its errors come back, and it lives and dies with the process that started it."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_core.output.checkpoint import PROCESS, THREAD, CheckpointDir, checkpoint_writer, load_checkpoint
from ddp_core.output.storage import StorageError
from ddp_core.output.writer_process import (
    PROCESS_WRITER,
    SharedBuffer,
    described,
    layout,
    rebuild,
    revived,
    view,
)

Pair = collections.namedtuple("Pair", "first second")
REPO = Path(__file__).resolve().parents[2]


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "plain": torch.randn(3, 5),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "transposed": torch.randn(4, 6).t(),
        "bfloat16": torch.randn(7).bfloat16(),
        "float16 odd": torch.randn(3).half(),
        "bool": torch.tensor([True, False, True]),
        "int64": torch.arange(9),
        "uint8 odd": torch.arange(5, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "expanded": torch.randn(3, 1).expand(3, 4),  # overlapping: written as a dense copy
        "sliced": torch.randn(6, 6)[1:4, ::2],  # a gap inside its span: written as a dense copy
    }


def test_every_tensor_crosses_over_equal_with_its_dtype_and_layout():
    original = tensors()
    state = collections.OrderedDict(original)
    state._metadata = {"": {"version": 1}}  # a module state dict's versions
    state["numbers"] = [1, 2.0, "three", None, np.arange(3), Pair(torch.ones(2), 4)]
    skeleton, placed, size = layout(state)
    assert len(placed) == len(original) + 1 and all(where.offset % 64 == 0 for _, where in placed)
    buffer = SharedBuffer()
    try:
        mapping = buffer.fit(size)
        for tensor, where in placed:
            view(mapping, where).copy_(tensor)
        back = rebuild(skeleton, mapping)
        assert type(back) is collections.OrderedDict and back._metadata == state._metadata
        for name, tensor in original.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
            if name not in ("expanded", "sliced"):
                assert back[name].stride() == tensor.stride(), name
        numbers = back["numbers"]
        assert numbers[:4] == [1, 2.0, "three", None] and (numbers[4] == np.arange(3)).all()
        assert isinstance(numbers[5], Pair) and torch.equal(numbers[5].first, torch.ones(2)) and numbers[5].second == 4
        del back, numbers
    finally:
        buffer.close()


@pytest.mark.parametrize(
    "choice, device, expected",
    [
        ("auto", "cuda", PROCESS),
        ("auto", "cpu", THREAD),
        ("thread", "cuda", THREAD),
        ("process", "cpu", PROCESS),
    ],
)
def test_auto_is_a_process_on_cuda_and_a_thread_on_cpu(choice, device, expected):
    assert checkpoint_writer(choice, torch.device(device)) == expected


@pytest.fixture
def writer():
    """The process writer of this test process, ended after the test."""
    yield PROCESS_WRITER
    PROCESS_WRITER.close()


def test_the_process_writes_what_a_thread_writes_and_the_steps_after_the_save_change_nothing(tmp_path, writer):
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    by_process = CheckpointDir(tmp_path / "process", keep=2, background=True, writer=PROCESS)
    by_thread = CheckpointDir(tmp_path / "thread", keep=2, background=True, writer=THREAD)
    saved = {}
    for step in (1, 2, 3):
        for checkpoints in (by_process, by_thread):
            checkpoints.save(step, lambda: {"model": model.state_dict(), "rng": torch.get_rng_state()}, {"step": step})
        saved[step] = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)  # the next steps, while the write may still be in flight
    by_process.wait()
    for checkpoints in (by_process, by_thread):
        names = sorted(path.name for path in checkpoints.dir.iterdir())
        assert names == ["last.pt", "step_00000002.pt", "step_00000003.pt"]
    written, expected = load_checkpoint(by_process.last), load_checkpoint(by_thread.last)
    assert written.keys() == expected.keys() and written["step"] == 3
    assert torch.equal(written["model"]["weight"], saved[3]) and torch.equal(written["rng"], expected["rng"])
    assert written["model"]["weight"].stride() == expected["model"]["weight"].stride()


def test_a_failed_write_is_raised_by_the_next_wait_and_a_stop_signal_leaves_the_writer_be(tmp_path, writer):
    checkpoints = CheckpointDir(tmp_path / "run", keep=2, background=True, writer=PROCESS)
    checkpoints.path_for(1).mkdir(parents=True)  # a folder where the file goes: the rename fails
    checkpoints.save(1, lambda: {"model": {"w": torch.ones(3)}})
    with pytest.raises(IsADirectoryError, match="step_00000001.pt"):
        checkpoints.wait()
    os.kill(writer.pid, signal.SIGTERM)  # a stop is the run's to handle: its last checkpoint is still written
    checkpoints.save(2, lambda: {"model": {"w": torch.full((3,), 2.0)}})
    checkpoints.wait()
    assert torch.equal(load_checkpoint(checkpoints.last)["model"]["w"], torch.full((3,), 2.0))


class EndsTheWriter:
    """Unpickled by the writer, it ends that process mid-request, as the out-of-memory killer would."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_writer_that_died_is_named_and_the_next_save_starts_another(tmp_path, writer, caplog):
    checkpoints = CheckpointDir(tmp_path / "run", keep=2, background=True, writer=PROCESS)
    checkpoints.save(1, lambda: {"model": {"w": torch.ones(3)}})
    checkpoints.wait()
    first = writer.pid
    checkpoints.save(2, lambda: {"model": {"w": torch.ones(3)}, "ends": EndsTheWriter()})
    with pytest.raises(RuntimeError, match=r"the checkpoint writer process ended \(exit code 3\) before writing .*"):
        checkpoints.wait()
    checkpoints.save(3, lambda: {"model": {"w": torch.ones(3)}})
    checkpoints.wait()
    assert first is not None and writer.pid not in (None, first) and load_checkpoint(checkpoints.last)["step"] == 3
    assert f"the checkpoint writer process (pid {first}) had ended, exit code 3: starting another" in caplog.text


def test_the_writer_dies_with_the_process_that_started_it(tmp_path):
    script = (
        "import os, signal, sys\n"
        "from ddp_core.output.writer_process import PROCESS_WRITER\n"
        "from ddp_core.output.checkpoint import CheckpointDir\n"
        "import torch\n"
        f"checkpoints = CheckpointDir({str(tmp_path / 'run')!r}, background=True, writer='process')\n"
        "checkpoints.save(1, lambda: {'w': torch.ones(2)})\n"
        "checkpoints.wait()\n"  # connected: its pid is known
        "print(PROCESS_WRITER.pid, flush=True)\n"
        "sys.stdin.read()\n"  # until the test has read the pid
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pid = int(parent.stdout.readline())
    assert Path(f"/proc/{pid}").exists()
    parent.stdin.close()
    assert parent.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)  # polling for the kernel's kill; the condition decides
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_forked_child_starts_without_the_parents_writer(tmp_path, writer):
    checkpoints = CheckpointDir(tmp_path / "run", keep=2, background=True, writer=PROCESS)
    checkpoints.save(1, lambda: {"w": torch.ones(2)})
    checkpoints.wait()
    parent_writer = writer.pid
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports what it inherited, and leaves without running the parent's exit handlers
        os.write(write, repr((PROCESS_WRITER.pid, PROCESS_WRITER._sock, PROCESS_WRITER._buffer.map)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as report:
        assert report.read() == "(None, None, None)"
    os.waitpid(child, 0)
    checkpoints.save(2, lambda: {"w": torch.ones(2)})  # the parent's writer is untouched
    checkpoints.wait()
    assert writer.pid == parent_writer and load_checkpoint(checkpoints.last)["step"] == 2


@pytest.mark.parametrize(
    "error, raised, line",
    [
        (StorageError("no space left: /run/x"), StorageError, "no space left: /run/x"),
        (IsADirectoryError(21, "Is a directory", "/run/step.pt"), IsADirectoryError, "Is a directory: '/run/step.pt'"),
        (PermissionError(13, "Permission denied"), PermissionError, "Permission denied"),
        (ValueError("bad"), RuntimeError, "ValueError in the checkpoint writer process: bad"),
    ],
)
def test_an_error_crosses_back_as_json_and_is_raised_as_its_kind(error, raised, line):
    back = revived(json.loads(json.dumps(described(error))))
    assert type(back) is raised and line in str(back)


def test_a_temp_folder_too_long_for_a_socket_name_is_not_used(tmp_path, writer, monkeypatch):
    long = tmp_path / ("t" * 120)  # a cluster's TMPDIR can be long; a socket's path has at most 107 bytes
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    checkpoints = CheckpointDir(tmp_path / "run", keep=2, background=True, writer=PROCESS)
    checkpoints.save(1, lambda: {"w": torch.ones(2)})
    checkpoints.wait()
    assert load_checkpoint(checkpoints.last)["step"] == 1 and not list(long.iterdir())
