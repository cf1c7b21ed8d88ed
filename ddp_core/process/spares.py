"""Warm spares: restarted workers forked from a warm parent that imported torch and ddp-lab once for the job.

A restart under ``--max-restarts`` starts every worker again, and each new interpreter imports torch, then
``torch._dynamo`` (DDP's constructor reads one of its settings): about 5 s of CPU per process, paid by the whole
job while it waits (bench.recovery measures it). With ``DDP_LAB_WARM_SPARES=1``, ``python -m ddp_core.torchrun``
starts, once a worker group is up and restarts remain, one *warm parent* per worker command: ``python -u -m
ddp_core.process.spares SOCKET MODULE``, which imports what a worker needs (``PRELOAD``) and then waits. When torchrun
starts the next group, each worker it would start as ``python -u -m MODULE ARGS`` is forked from that parent
instead: the child takes the worker's environment and arguments, its own session (as torchrun starts its
workers), and becomes ``python -m MODULE ARGS`` (``runpy``, as ``-m`` does). The imports are paid once per job,
not once per worker and restart, and a fault never waits for them after the first.

The parent is the launcher's child (its own session, killed when the launcher dies), and each worker it forks
is killed when the parent dies. torchrun sees a forked worker through ``Worker``, which stands for a ``Popen``
(its pid, ``poll``, ``wait``, signals): the parent reports each child's exit status to the launcher over the
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
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

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
        """A warm parent for ``count`` workers ``python -u -m module`` (one serves any number; 0: none), unless
        a live one is there already."""
        parent = self.parents.get((python, module))
        if count <= 0 or (parent is not None and parent.alive()):
            return
        if parent is not None:
            parent.stop()
        self.parents[(python, module)] = WarmParent(python, module, popen)

    def take(self, args: Any, env: dict[str, str] | None, **kwargs: Any) -> Worker | None:
        """The worker ``args`` (``python -u -m MODULE ...``) forked from a warm parent, or None where none fits."""
        args = [str(arg) for arg in args] if isinstance(args, (list, tuple)) else []
        redirected = kwargs.get("stdout") is not None or kwargs.get("stderr") is not None
        if len(args) < 4 or args[1:3] != ["-u", "-m"] or redirected or env is None:
            return None
        parent = self.parents.get((args[0], args[3]))
        return parent.fork(args, env) if parent is not None else None

    def stop(self) -> None:
        """At the job's end: the warm parents, and with them any worker of theirs still alive."""
        for parent in self.parents.values():
            parent.stop()
        self.parents.clear()


class WarmParent:
    """A ``python -u -m ddp_core.process.spares SOCKET MODULE`` process and the launcher's end of its socket (MODULE,
    which the parent does not read, names the workers it forks in ``ps``, where they show the parent's command)."""

    def __init__(self, python: str, module: str, popen: Callable[..., subprocess.Popen]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ddp-lab-spares-"))
        path = str(self.folder / "parent")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.process = popen(
            [python, "-u", "-m", __name__, path, module],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=partial(die_with_parent, os.getpid()),
        )
        self.connection: socket.socket | None = None  # once the parent has imported PRELOAD and connected
        self.closed = False  # the parent is gone: its workers went with it
        self.buffer = b""
        self.forked: list[int] = []  # pids of children not yet handed out
        self.exits: dict[int, int] = {}  # pid: exit code, as Popen.returncode gives it

    def alive(self) -> bool:
        return not self.closed and self.process.poll() is None

    def fork(self, args: list[str], env: dict[str, str]) -> Worker | None:
        """A child of the parent become ``args``; None when the parent is gone (a worker is then started as usual)."""
        if not self._connected():
            return None
        assert self.connection is not None
        try:
            self.connection.sendall(json.dumps({"argv": args[3:], "env": env}).encode() + b"\n")
        except OSError:
            self.closed = True
            return None
        while not self.forked:
            if not self.alive():
                return None
            self.collect(WAIT_STEP_S)
        return Worker(self.forked.pop(0), args, self)

    def _connected(self) -> bool:
        """Wait for the parent to have imported what a worker needs (it connects then)."""
        while self.connection is None:
            if not self.alive():
                return False
            self.listener.settimeout(WAIT_STEP_S)
            try:
                self.connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return False
        return not self.closed

    def collect(self, timeout: float) -> None:
        """Read what the parent reported (a child forked, a child's exit), waiting up to ``timeout`` seconds."""
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
            kind, pid, *code = line.decode().split()
            if kind == "forked":
                self.forked.append(int(pid))
            else:
                self.exits[int(pid)] = int(code[0])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.closed = True
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


def serve(path: str) -> dict[str, Any]:
    """The warm parent: import ``PRELOAD``, connect to the launcher, fork a child for each order it sends and
    report the child's pid and, once reaped, its exit code. Returns only in a child: the order it is to run."""
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the imported objects stay out of the children's collections: fewer pages copied on write
    launcher = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    launcher.connect(path)
    wake_reader, wake_writer = socket.socketpair()
    wake_writer.setblocking(False)
    signal.set_wakeup_fd(wake_writer.fileno())
    signal.signal(signal.SIGCHLD, lambda number, frame: None)  # a Python handler, so that the wake-up fd is written
    me, buffer = os.getpid(), b""
    while True:
        readable = select.select([launcher, wake_reader], [], [])[0]
        if wake_reader in readable:
            wake_reader.recv(4096)
            _reap(launcher)
        if launcher not in readable:
            continue
        data = launcher.recv(1 << 16)
        if not data:  # the launcher ended: this process's children end with it (die_with_parent)
            os._exit(0)
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                die_with_parent(me)
                os.setsid()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for sock in (launcher, wake_reader, wake_writer):
                    sock.close()
                return json.loads(line)
            launcher.sendall(f"forked {pid}\n".encode())


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
    become_worker(serve(sys.argv[1]))
