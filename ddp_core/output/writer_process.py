"""A checkpoint writer in a process of its own, so that ``torch.save`` never holds the training process's GIL.

Tensors go over one memfd, the rest pickled over a Unix socket; the answer is JSON (docs/decisions.md, "What a
failure costs").
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_core.output.storage import StorageError
from ddp_core.training.transfer import rebuilt

log = logging.getLogger(__name__)
ALIGN = 64  # each tensor's bytes start at a multiple of this: any dtype's view of the buffer is aligned
_LENGTH = struct.Struct("!Q")  # a message's length, before it
_PR_SET_PDEATHSIG = 1
SHORT_PATH = 80  # a temp folder longer than this (a cluster's TMPDIR) leaves too little for a socket's name
ENTRY = "ddp_core.output.checkpoint_writer"  # the writer: ``python -m`` it, the address to connect to its argument


def socket_folder(prefix: str) -> str:
    """A new mode-0700 folder for a Unix socket: in the temp folder, or /tmp where a long TMPDIR leaves too little of
    a socket path's 107 bytes."""
    short = len(tempfile.gettempdir()) < SHORT_PATH
    return tempfile.mkdtemp(prefix=prefix, dir=None if short else "/tmp")


@dataclass(frozen=True)
class Placed:
    """A tensor in the shared buffer: its bytes from ``offset``, viewed with its dtype, size and stride."""

    offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    span: int  # elements from its first to its last, the stride included


def _span(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def layout(state: Any) -> tuple[Any, list[tuple[torch.Tensor, Placed]], int]:
    """``state`` with every tensor replaced by its ``Placed``, the tensors with their places, and the bytes needed."""
    placed: list[tuple[torch.Tensor, Placed]] = []
    end = 0

    def place(value: Any) -> Any:
        nonlocal end
        if not isinstance(value, torch.Tensor):
            return value
        tensor = value.detach()  # itself where its elements fill their span once (channels_last too), else a copy
        if _span(tensor) != tensor.numel() or any(s < 0 for s in tensor.stride()):
            tensor = tensor.contiguous()
        offset = -(-end // ALIGN) * ALIGN
        where = Placed(offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), _span(tensor))
        end = offset + where.span * tensor.element_size()
        placed.append((tensor, where))
        return where

    skeleton = rebuilt(state, place)
    return skeleton, placed, end


def view(mapping: mmap.mmap, where: Placed) -> torch.Tensor:
    """The tensor at ``where``, a view with a storage of its own (torch.save refuses mixed dtypes over one)."""
    if where.span == 0:
        return torch.empty_strided(where.size, where.stride, dtype=where.dtype)
    flat = torch.frombuffer(mapping, dtype=where.dtype, count=where.span, offset=where.offset)
    return flat.as_strided(where.size, where.stride)


def rebuild(skeleton: Any, mapping: mmap.mmap) -> Any:
    """``layout``'s skeleton with each ``Placed`` turned back into its tensor, a view of ``mapping``."""
    return rebuilt(skeleton, lambda value: view(mapping, value) if isinstance(value, Placed) else value)


class SharedBuffer:
    """One memfd and its mapping in this process, grown (replaced) when a state needs more."""

    def __init__(self) -> None:
        self.fd, self.size = -1, 0
        self.map: mmap.mmap | None = None

    def fit(self, size: int) -> mmap.mmap:
        if size > self.size or self.map is None:
            self.close()
            self.size = max(size, ALIGN)
            self.fd = os.memfd_create("ddp-lab-checkpoint", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        return self.map

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.size = 0


def send(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [_LENGTH.pack(len(data))], fds or [])
    sock.sendall(data)


def receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next message's bytes and the descriptors sent with it; None when the other end closed."""
    header, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 4)
    if not header:
        return None
    header += _recv_exactly(sock, _LENGTH.size - len(header))  # the rest of a header split over two reads (or b"")
    (length,) = _LENGTH.unpack(header)
    return _recv_exactly(sock, length), list(fds)


def _recv_exactly(sock: socket.socket, length: int) -> bytes:
    chunks, left = [], length
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the checkpoint writer's socket closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class ProcessWriter:
    """This process's writer process: ``pack`` a state into shared memory in the pause, ``write`` it from
    ``BackgroundWrites``' thread."""

    def __init__(self) -> None:
        self._buffer = SharedBuffer()
        self._sock: socket.socket | None = None  # connected to the writer
        self._listener: socket.socket | None = None  # until it connects
        self._folder: str | None = None  # the listener's private folder
        self._process: subprocess.Popen | None = None
        self.pid: int | None = None  # the writer's, once connected (the kernel says whose end it is)
        self._lock = threading.Lock()  # start() may come from the loop and from the waiting thread

    def start(self) -> None:
        """Start the writer unless it runs (before the first save: it imports torch). It connects to a private socket
        rather than inheriting one, so a wrapper standing for ``python`` makes no difference."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            if self._process is not None:  # it died (the out-of-memory killer, say): the next write needs one
                log.warning(
                    "the checkpoint writer process (pid %s) had ended, exit code %s: starting another",
                    self.pid or self._process.pid,
                    self._process.returncode,
                )
            self._disconnect()
            self._folder = socket_folder("ddp-lab-writer-")
            address = os.path.join(self._folder, "socket")
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(address)
            self._listener.listen(1)
            root = Path(__file__).resolve().parents[2]  # where ``-m`` finds ddp_core: the requests' paths are absolute
            self._process = subprocess.Popen([sys.executable, "-m", ENTRY, address], cwd=root)

    def _connected(self) -> socket.socket:
        """The socket to the writer, once it has connected (it may still be importing torch)."""
        if self._sock is not None:
            return self._sock
        assert self._listener is not None and self._process is not None
        self._listener.settimeout(1.0)
        while True:
            try:
                sock, _ = self._listener.accept()
                break
            except socket.timeout:
                if self._process.poll() is not None:
                    raise RuntimeError(
                        f"the checkpoint writer process ended (exit code {self._process.returncode}) before it "
                        "connected; its error is above"
                    ) from None
        sock.settimeout(None)
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.pid = struct.unpack("3i", credentials)[0]
        self._close_listener()
        self._sock = sock
        return sock

    def pack(self, state: Any) -> bytes:
        """Copy ``state``'s tensors into the shared buffer and pickle the rest, for ``write``; the writer thread then
        has no Python work left that would take the GIL."""
        skeleton, placed, size = layout(state)
        mapping = self._buffer.fit(size)
        for tensor, where in placed:
            view(mapping, where).copy_(tensor)
        return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    def write(self, directory: Path, keep: int, path: Path, packed: bytes) -> None:
        """The writer writes ``packed`` as ``path`` (``CheckpointDir.write``); raises what the write raised there."""
        self.start()
        sock = self._connected()
        where = {"directory": os.path.abspath(directory), "keep": keep, "path": os.path.abspath(path)}
        try:
            send(sock, json.dumps({**where, "size": self._buffer.size}).encode(), [self._buffer.fd])
            send(sock, packed)
            answer = receive(sock)
        except (BrokenPipeError, ConnectionResetError):
            answer = None
        if answer is None:
            code = self._process.wait() if self._process is not None else None
            raise RuntimeError(f"the checkpoint writer process ended (exit code {code}) before writing {path}")
        error = json.loads(answer[0])
        if error is not None:
            raise revived(error)

    def close(self) -> None:
        """End the writer: it leaves once its socket closes (the next ``write`` starts another)."""
        with self._lock:
            self._disconnect()
            if self._process is not None:
                self._process.wait()
                self._process = None
        self._buffer.close()

    def forget(self) -> None:
        """In a forked child: drop the parent's writer, socket and buffer without touching them."""
        self.__init__()  # type: ignore[misc]

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.pid = None
        self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def die_with_parent() -> None:
    """Linux: killed by the kernel when its parent ends; stop signals are ignored, so the run's last checkpoint is
    still written."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the call
        os._exit(0)


def serve(sock: socket.socket, write: Callable[[Path, int, Path, Any], None]) -> None:
    """The writer's loop: each request rebuilt over its memfd and handed to ``write``; answered null or the error.
    It unpickles only what its own parent sent over a private socket; only JSON goes back."""
    while (header := receive(sock)) is not None and (body := receive(sock)) is not None:
        where, fds = json.loads(header[0]), header[1]
        mapping = mmap.mmap(fds[0], where["size"])
        for fd in fds:
            os.close(fd)
        skeleton = pickle.loads(body[0])
        target = Path(where["directory"]), where["keep"], Path(where["path"])
        try:
            write(*target, rebuild(skeleton, mapping))
            error = None
        except BaseException as raised:  # handed back: the training process raises it
            error = described(raised)
        with contextlib.suppress(BufferError):  # a view still held somewhere: the mapping goes with it
            mapping.close()
        send(sock, json.dumps(error).encode())


def described(error: BaseException) -> dict[str, Any]:
    """An error as JSON can carry it: its kind, its line, and an OSError's errno and file."""
    kind = "storage" if isinstance(error, StorageError) else "os" if isinstance(error, OSError) else "other"
    described = {"kind": kind, "type": type(error).__name__, "message": str(error)}
    if isinstance(error, OSError):
        described.update(errno=error.errno, strerror=error.strerror, filename=error.filename and str(error.filename))
    return described


def revived(error: dict[str, Any]) -> BaseException:
    """``described``'s error as the training process raises it: a StorageError, an OSError, or a RuntimeError."""
    if error["kind"] == "storage":
        return StorageError(error["message"])
    if error["kind"] == "os" and error["errno"] is not None:
        return OSError(error["errno"], error["strerror"], error["filename"])
    return RuntimeError(f"{error['type']} in the checkpoint writer process: {error['message']}")


PROCESS_WRITER = ProcessWriter()  # this process's: global rank 0 writes a run's checkpoints
# A process forked from this one (a warm spare, a fork server's child) starts with no writer of its own: the inherited
# socket and shared buffer are the parent's, and writing into them would change what the parent's writer reads.
os.register_at_fork(after_in_child=PROCESS_WRITER.forget)
