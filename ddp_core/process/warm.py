"""Fast restarts: restarted workers forked from a warm parent that imported torch once for the job.

Under ``--max-restarts``, ``ddp_core.torchrun`` starts a *warm parent* (``python -m ddp_core.process.warm``, dead
with the launcher) that imports ``PRELOAD`` and serves a Unix socket, and gives each worker the command ``python -u
-m ddp_core.process.warm -u -m MODULE ARGS``, a thin client (standard library only). In the first group the client
``exec``s the worker; in a restarted one it sends the parent its standard streams, environment, directory and
arguments, and the parent forks a child that runs MODULE as ``python -m`` does, titled so in ``ps``. To torchrun the
client is the worker: it forwards signals and ends as the child did; one SIGKILLed takes the other with it. Under
``--heal`` (process.heal) the client is the parent of each worker, and replaces one that died by a fault. A
variable read while ``PRELOAD`` is imported keeps the launcher's value (``OMP_NUM_THREADS`` is applied again).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ddp_core.exit_codes import FINISHED_EXIT_CODES
from ddp_core.process import heal, timeline
from ddp_core.process.heartbeat import JOB_DIR_ENV
from ddp_core.process.orphans import LAUNCHER_PID_VARIABLE, die_with_launcher, die_with_parent

VARIABLE = "DDP_LAB_FAST_RESTART"  # 0: restarted workers start cold
SOCKET_VARIABLE = "DDP_LAB_WARM_PARENT"  # the parent's socket, for the clients
# What a worker imports before its first step (the experiment's own module is the user's: imported when it runs).
# None of them initialises CUDA: a child forked after that could not use it.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "ddp_core.experiment")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def client_args(entrypoint: str, args: list[str], restarts: int, numa: bool) -> list[str] | None:
    """The client's arguments for workers ``entrypoint args``; None where restarts start cold. Under --heal the
    client supervises its worker (``supervise``) whether the parent forks or not."""
    used = restarts > 0 and not numa and entrypoint == sys.executable
    return ["-u", "-m", __name__, *args] if used and (forks(args) or os.environ.get(heal.VARIABLE) == "1") else None


def forks(args: list[str]) -> bool:
    """Whether restarted workers ``args`` fork from the warm parent: a module's (``-u -m``), fast restarts on."""
    return os.environ.get(VARIABLE) != "0" and args[:2] == ["-u", "-m"]


def start() -> Callable[[], None]:
    """The launcher's side: the warm parent, started on a socket that clients may connect to at once (they wait
    for its imports); returns what stops it."""
    from ddp_core.output.writer_process import socket_folder  # here: it imports torch, which a client must not

    folder = socket_folder("ddp-lab-warm-")
    os.environ[SOCKET_VARIABLE] = path = os.path.join(folder, "parent")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:  # the parent's only: once it is gone, a
        listener.bind(path)  # client finds nobody and starts cold
        listener.listen(64)
        env = {**os.environ, LAUNCHER_PID_VARIABLE: str(os.getpid())}
        parent = subprocess.Popen(
            [sys.executable, "-u", "-m", __name__], stdin=listener, env=env, start_new_session=True
        )

    def stop() -> None:
        os.environ.pop(SOCKET_VARIABLE, None)
        parent.kill()  # no child of its is left: torchrun waited for its workers (a left one dies with it)
        parent.wait()
        shutil.rmtree(folder, ignore_errors=True)

    return stop


def client(argv: list[str]) -> NoReturn:
    """A worker: ``supervise``d under --heal or in a restarted group, else (or if no parent answers) ``exec``'d."""
    path = os.environ.pop(SOCKET_VARIABLE, "")
    healing = os.environ.get(heal.VARIABLE) == "1"
    if healing or (path and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        supervise(argv, path, healing)
    os.execv(sys.executable, [sys.executable, *argv])


def request(path: str, argv: list[str]) -> tuple[int, Callable[[], int]] | None:
    """A child forked by the parent at ``path``: its pid and what waits for its status; None if none answered."""
    with contextlib.suppress(OSError):  # a closed standard stream, or no parent: the worker starts cold
        parent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        parent.connect(path)
        message = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}) + "\n"
        socket.send_fds(parent, [message.encode()], [0, 1, 2])
        replies = parent.makefile("rb")  # holds the connection open: its close would have the parent kill the child
        child = replies.readline()
        if child:  # the status follows when the child ends; none: its parent went without a word
            return int(child), lambda: int(replies.readline() or -signal.SIGKILL)
    return None


def end_as(code: int) -> NoReturn:
    """Exit with ``code``, a child's status: killed by the same signal where it is minus one."""
    if code < 0:
        with contextlib.suppress(OSError):  # SIGKILL's action cannot be set, nor needs to be
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def supervise(argv: list[str], path: str, healing: bool) -> None:
    """Stand for a worker forked by the parent at ``path``: forward it signals, end as it did. Under --heal the
    first worker starts cold, and one that dies by a fault (a code not in ``FINISHED_EXIT_CODES``, no stop or its
    signal forwarded) is replaced, forked or cold, while this node's budget lasts (``claim``). Returns where no
    worker could be forked (no --heal): the client execs it."""
    if healing:
        die_with_launcher()  # and each worker with this client: the chain torchrun's own worker would be in
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # a signal sent before the child is known waits for it
    child, forwarded = [0], set()

    def forward(number: int, frame: object) -> None:
        forwarded.add(number)
        with contextlib.suppress(ProcessLookupError):  # it has just ended: its status follows
            os.kill(child[0], number)

    for number in FORWARDED:
        signal.signal(number, forward)
    code = replaced = 0
    while True:
        try:
            started = (path and (replaced or not healing) and request(path, argv)) or (healing and _cold(argv))
        except OSError as error:
            print(f"--heal: rank {os.environ.get('RANK')}'s worker could not start: {error}", file=sys.stderr)
            end_as(code or 1)
        if not started:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # an exec keeps the mask
            return
        child[0], wait = started
        began = time.time()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # what came meanwhile is forwarded now
        code = wait()
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        stated = code in FINISHED_EXIT_CODES or forwarded & {signal.SIGTERM, signal.SIGINT, -code}  # or a stop
        if not healing or stated or not trained_since(began) or not claim():
            end_as(code)
        replaced += 1
        os.environ[heal.REPLACEMENT_VARIABLE] = str(replaced)
        timeline.mark("replaced", replacement=replaced, code=code)  # bench.recovery


def _cold(argv: list[str]) -> tuple[int, Callable[[], int]]:
    """A worker in a new interpreter: this client's child, in a session of its own as torchrun starts one (a
    signal to the client's group reaches the worker once, forwarded), dead with the client."""
    client = os.getpid()

    def prepare() -> None:  # in the child, before exec: an exec keeps the mask
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        die_with_parent(client)

    worker = subprocess.Popen([sys.executable, *argv], preexec_fn=prepare, start_new_session=True)
    return worker.pid, worker.wait


def trained_since(began: float) -> bool:
    """This rank's worker took a step since ``began`` (its heartbeat): one that died in its set-up, or a replacement
    that died joining, has no peer to heal with (the job ends with one report)."""
    beat = os.path.join(os.environ.get(JOB_DIR_ENV, ""), f"rank_{os.environ.get('RANK')}")
    with contextlib.suppress(OSError, ValueError), open(beat) as file:
        return os.fstat(file.fileno()).st_mtime >= began and int(file.readline()) > 0
    return False


def claim() -> bool:
    """One of this node's replacements, shared by its clients: each a file, created by one client only."""
    folder = os.environ.get(JOB_DIR_ENV, "")
    for number in range(heal.budget() if folder else 0):
        with contextlib.suppress(FileExistsError):
            os.close(os.open(os.path.join(folder, f"replacement_{number}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
    return False


def serve() -> tuple[dict[str, Any], list[int], int]:
    """The warm parent: import ``PRELOAD``, fork a child per client of its standard input (the listening socket), send
    each child's exit status to its client, SIGKILL a child whose client is gone. Returns in a child only."""
    die_with_launcher()
    for name in PRELOAD:
        importlib.import_module(name)
    if sys.modules["torch"].cuda.is_initialized():  # a fork would leave the children without CUDA
        raise SystemExit("ddp_core.process.warm: CUDA was initialised while importing; restarted workers start cold")
    gc.freeze()  # the imported objects stay out of the children's collections: fewer pages copied on write
    listener = socket.socket(fileno=0)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[socket.socket, int]] = {}  # pid: its client's connection, its pidfd
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                if (child := _fork(listener, selector, children)) is not None:
                    return child
                continue
            if key.data not in children:  # its child ended earlier in this same round
                continue
            connection, pidfd = children[key.data]
            if key.fileobj is connection:  # a client never writes after its request: readable, it is gone
                selector.unregister(connection)
                os.kill(key.data, signal.SIGKILL)
                continue
            status = os.waitstatus_to_exitcode(os.waitpid(key.data, 0)[1])  # minus the signal that killed it
            with contextlib.suppress(OSError):  # the client is gone
                connection.sendall(f"{status}\n".encode())
            selector.unregister(pidfd)
            with contextlib.suppress(KeyError):
                selector.unregister(connection)
            connection.close()
            os.close(pidfd)
            del children[key.data]


def _fork(
    listener: socket.socket, selector: selectors.BaseSelector, children: dict[int, tuple[socket.socket, int]]
) -> tuple[dict[str, Any], list[int], int] | None:
    """A child for the next client; in the child, what it is to become."""
    connection, _ = listener.accept()
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while data and not data.endswith(b"\n"):  # the rest of the request (none: the client went)
        data = data + more if (more := connection.recv(1 << 16)) else b""
    pid = os.fork() if data else -1  # nothing to flush first: the parent runs unbuffered (-u) and prints nothing
    if pid == 0:
        for closed in (selector, listener, connection):
            closed.close()
        for other, pidfd in children.values():
            other.close()
            os.close(pidfd)
        return json.loads(data), fds, os.getppid()
    for fd in fds:
        os.close(fd)
    if pid < 0:  # the client went mid-request
        connection.close()
        return None
    children[pid] = (connection, os.pidfd_open(pid))  # before Linux 5.3 this ends the parent: restarts go cold
    selector.register(connection, selectors.EVENT_READ, pid)
    selector.register(children[pid][1], selectors.EVENT_READ, pid)
    with contextlib.suppress(OSError):  # a client gone already is seen as gone next
        connection.sendall(f"{pid}\n".encode())
    return None


def become(request: dict[str, Any], fds: list[int], parent: int) -> None:
    """The forked child: dead with its parent, in a session of its own, the client's streams, directory and
    environment, then the worker's module as ``python -m`` runs it (an exception or exit ends this interpreter)."""
    die_with_parent(parent)
    os.setsid()
    for target, fd in enumerate(fds):  # each above 2: the parent's own 0-2 were open when they came
        os.dup2(fd, target)
        os.close(fd)
    argv = request["argv"]  # -u -m MODULE ARGS
    with contextlib.suppress(ImportError):  # without setproctitle (not installed) ps shows the parent's command
        from setproctitle import setproctitle

        setproctitle(" ".join([sys.executable, *argv]))  # first: it finds its room after the original environment
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it when the parent imported it
        sys.modules["torch"].set_num_threads(int(threads))
    timeline.mark("warm", parent=parent)  # bench.recovery and the tests: this worker came from the warm parent
    sys.argv = argv[2:]  # run_module puts the module's file first, as python -m does
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1:]:
        client(sys.argv[1:])
    become(*serve())
