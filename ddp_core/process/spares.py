"""Warm spares: restarted workers forked from a warm parent that imported torch and ddp-lab once for the job.

A restart under ``--max-restarts`` starts every worker again, and each new interpreter imports torch, then
``torch._dynamo`` (DDP's constructor reads one of its settings): about 5 s of CPU per process, paid by the whole
job while it waits (bench.recovery measures it). With ``DDP_LAB_WARM_SPARES=1``, ``python -m ddp_core.torchrun``
starts, once a worker group is up and restarts remain, one *warm parent* per worker command (``python -u -m
ddp_core.process.spares SOCKET COUNT MODULE``), which imports what a worker needs (``PRELOAD``) and forks COUNT
children ahead, one per local worker, each connected to the launcher and waiting. When torchrun starts the next
group, each worker it would start as ``python -u -m MODULE ARGS`` is one of those children instead: it is sent the
worker's environment and arguments and becomes ``python -m MODULE ARGS`` (``runpy``, as ``-m`` does), in a
session of its own (as torchrun starts its workers), and the parent forks another ahead. The imports are paid
once per job, not once per worker and restart, and only a fault before they are done waits for them.

The parent is the launcher's child (its own session, killed when the launcher dies), and each child it forks is
killed when the parent dies. torchrun sees a forked worker through ``Worker``, which stands for a ``Popen`` (its
pid, ``poll``, ``wait``, signals): the parent reaps it and reports its exit status to the launcher over the
socket. What a fork does not reproduce: a fresh interpreter's start with the worker's environment (a variable
read while torch or ddp-lab is imported keeps the value it had when the parent started; ``OMP_NUM_THREADS`` is
applied again), the process tree (a worker's parent is the warm parent, its command line the parent's), and
output redirected by torchrun (``--redirects``, ``--tee``, ``--log-dir``): a worker whose output goes to a file
is started as before. The parent imports while the first group trains, on the same cores.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ddp_core.output.writer_process import socket_folder
from ddp_core.process import timeline
from ddp_core.process.orphans import die_with_parent

VARIABLE = "DDP_LAB_WARM_SPARES"
# What a worker imports before its first step: torch, DDP's lazy torch._dynamo, ddp-lab's run (the experiment's
# own module is imported when it runs: its code is the user's). None of them touches CUDA: a fork after CUDA's
# initialisation would leave the child without it.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "ddp_core.experiment")
WAIT_STEP_S = 0.5  # how often a launcher waiting for its warm parent checks that the parent is still alive


def enabled() -> bool:
    return os.environ.get(VARIABLE, "") not in ("", "0")


class Spares:
    """The launcher's side: a warm parent for each (python, module) workers are started with."""

    def __init__(self) -> None:
        self.parents: dict[tuple[str, str], WarmParent] = {}

    def start(self, python: str, module: str, count: int, popen: Callable[..., subprocess.Popen]) -> None:
        """A warm parent for workers ``python -u -m module``, ``count`` of them forked ahead (0: none), unless a
        live one is there already."""
        parent = self.parents.get((python, module))
        if count <= 0 or (parent is not None and parent.alive()):
            return
        if parent is not None:
            parent.stop()
        self.parents[(python, module)] = WarmParent(python, module, count, popen)

    def take(self, args: Any, env: dict[str, str] | None, **kwargs: Any) -> Worker | None:
        """The worker ``args`` (``python -u -m MODULE ...``) forked from a warm parent, or None where none fits."""
        args = [str(arg) for arg in args] if isinstance(args, (list, tuple)) else []
        redirected = kwargs.get("stdout") is not None or kwargs.get("stderr") is not None
        if len(args) < 4 or args[1:3] != ["-u", "-m"] or redirected or env is None:
            return None
        parent = self.parents.get((args[0], args[3]))
        worker = parent.fork(args, env) if parent is not None else None
        if worker is not None:
            timeline.mark("forked", worker=worker.pid)  # bench.recovery and the tests: this one started warm
        return worker

    def stop(self) -> None:
        """At the job's end: the warm parents, and with them any worker of theirs still alive."""
        for parent in self.parents.values():
            parent.stop()
        self.parents.clear()


class WarmParent:
    """A ``python -u -m ddp_core.process.spares SOCKET COUNT MODULE`` process and the launcher's end of its socket
    (MODULE, which the parent does not read, names the workers it forks in ``ps``, where they show the parent's
    command). The parent keeps COUNT children forked ahead, each connected to the launcher and waiting for the
    worker it is to become: handing one out is a write, with no wait for the parent."""

    def __init__(self, python: str, module: str, count: int, popen: Callable[..., subprocess.Popen]) -> None:
        self.folder = Path(socket_folder("ddp-lab-spares-"))
        path = str(self.folder / "parent")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.process = popen(
            [python, "-u", "-m", __name__, path, str(count), module],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=partial(die_with_parent, os.getpid()),
        )
        self.connection: socket.socket | None = None  # to the parent, once it has imported PRELOAD
        self.idle: list[tuple[int, socket.socket]] = []  # children forked ahead: pid, connection
        self.closed = False  # the parent is gone: its workers went with it
        self.buffer = b""
        self.exits: dict[int, int] = {}  # pid: exit code, as Popen.returncode gives it

    def alive(self) -> bool:
        return not self.closed and self.process.poll() is None

    def fork(self, args: list[str], env: dict[str, str]) -> Worker | None:
        """A child of the parent become ``args``; None when the parent is gone (a worker is then started as usual)."""
        while not self.idle:  # only before the parent has imported PRELOAD, or if it falls behind
            if not self.alive():
                return None
            self._accept(WAIT_STEP_S)
        pid, child = self.idle.pop(0)
        try:
            child.sendall(json.dumps({"argv": args[3:], "env": env}).encode() + b"\n")
        except OSError:
            return self.fork(args, env) if self.alive() else None  # that child died: the next one
        finally:
            child.close()
        try:
            assert self.connection is not None
            self.connection.sendall(b"fork\n")  # one more ahead, for the next worker
        except OSError:
            self.closed = True
        return Worker(pid, args, self)

    def _accept(self, timeout: float) -> None:
        """Take the connections that came: the parent's (``parent``), then each child's (``idle PID``)."""
        self.listener.settimeout(timeout)
        while True:
            try:
                connection, _ = self.listener.accept()
            except (TimeoutError, BlockingIOError):
                return
            except OSError:
                self.closed = True
                return
            self.listener.settimeout(0)
            connection.settimeout(None)
            line = _first_line(connection).decode().split()
            if line[:1] == ["parent"]:
                self.connection = connection
            elif line[:1] == ["idle"] and len(line) == 2:
                self.idle.append((int(line[1]), connection))
            else:
                connection.close()

    def collect(self, timeout: float) -> None:
        """Read the exits the parent reported, waiting up to ``timeout`` seconds for one."""
        if self.connection is None or self.closed:
            return
        if not select.select([self.connection], [], [], timeout)[0]:
            return
        try:
            data = self.connection.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            _, pid, code = line.decode().split()
            self.exits[int(pid)] = int(code)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.closed = True
        for _, child in self.idle:
            child.close()
        self.idle.clear()
        for sock in (self.connection, self.listener):
            if sock is not None:
                sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class Worker:
    """What torchrun uses of a worker's ``Popen`` (``pid``, ``poll``, ``wait``, ``returncode``, signals), for a
    worker that a warm parent forked: its exit status comes from the parent, which reaps it."""

    def __init__(self, pid: int, args: list[str], parent: WarmParent) -> None:
        self.pid, self.args, self.parent = pid, args, parent
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.parent.collect(0)
            self.returncode = self.parent.exits.pop(self.pid, None)
            if self.returncode is None and self.parent.closed:
                self.returncode = -signal.SIGKILL  # its parent is gone, and the kernel killed it with it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = WAIT_STEP_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.parent.collect(min(left, WAIT_STEP_S))
        return code

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def serve(path: str, count: int) -> dict[str, Any]:
    """The warm parent: import ``PRELOAD``, connect to the launcher, keep ``count`` children forked ahead (one more
    each time the launcher hands one out) and report each child's exit code once reaped. Returns only in a child:
    the order it is to run."""
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the imported objects stay out of the children's collections: fewer pages copied on write
    launcher = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    launcher.connect(path)
    launcher.sendall(b"parent\n")
    wake_reader, wake_writer = socket.socketpair()
    wake_writer.setblocking(False)
    signal.set_wakeup_fd(wake_writer.fileno())
    signal.signal(signal.SIGCHLD, lambda number, frame: None)  # a Python handler, so that the wake-up fd is written
    me, buffer, ahead = os.getpid(), b"", count
    while True:
        for _ in range(ahead):
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                for sock in (launcher, wake_reader, wake_writer):
                    sock.close()
                return _wait_for_an_order(path, me)
        ahead = 0
        readable = select.select([launcher, wake_reader], [], [])[0]
        if wake_reader in readable:
            wake_reader.recv(4096)
            _reap(launcher)
        if launcher in readable:
            data = launcher.recv(1 << 16)
            if not data:  # the launcher ended: this process's children end with it (die_with_parent)
                os._exit(0)
            buffer += data
            ahead = buffer.count(b"\n")
            buffer = buffer[buffer.rfind(b"\n") + 1 :]


def _reap(launcher: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            launcher.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            return


def _first_line(connection: socket.socket) -> bytes:
    """One line, read a byte at a time: what follows it on the connection is someone else's to read."""
    line = b""
    while not line.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            break
        line += byte
    return line


def _wait_for_an_order(path: str, parent: int) -> dict[str, Any]:
    """A child forked ahead: its own session, killed with its parent; it connects to the launcher and waits."""
    die_with_parent(parent)
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    launcher = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    launcher.connect(path)
    launcher.sendall(f"idle {os.getpid()}\n".encode())
    line = _first_line(launcher)
    launcher.close()
    if not line:  # the launcher closed it: the job is over
        os._exit(0)
    return json.loads(line)


def become_worker(order: dict[str, Any]) -> None:
    """The forked child: the worker's environment and arguments, then its module as ``python -m`` runs it."""
    os.environ.clear()
    os.environ.update(order["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    module, *arguments = order["argv"]
    sys.argv = [module, *arguments]  # run_module puts the module's file first, as ``python -m`` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    become_worker(serve(sys.argv[1], int(sys.argv[2])))
