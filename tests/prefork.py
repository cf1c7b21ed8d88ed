"""A stand-in for ``python`` whose ``-m MODULE`` processes fork from a server that has imported torch already.

    command = [prefork.python(), "-m", "ddp_core.torchrun", "--standalone", "--nproc-per-node=3",
               "-m", "experiments.toy", ...]
    subprocess.run(command, ...)   # as with sys.executable, a second or more of CPU cheaper per process

Every Python process an end-to-end test starts imports torch (about 1.5 s of CPU on the 2-core machine)
and, if it wraps a model in DDP, ``torch._dynamo`` (about 0.85 s more): most of the suite's CPU time is
that start-up, repeated in hundreds of processes (docs/benchmarks.md, "Test suite time without Docker
and Slurm"). ``python()`` returns the path of a small executable script, the *shim*, that a test uses in
place of ``sys.executable``. Run as ``shim [-u] -m MODULE ARGS...`` it sends its argument list,
environment, working directory and standard streams to this pytest process's *fork server*, which
imported torch (and the rest of ``PRELOADED``) once; the server forks, and the child becomes
``python -m MODULE ARGS...``: the same streams, environment and directory, ``sys.argv`` and ``__main__``
as ``python -m`` makes them, its own session (as torchrun starts its workers), and on exit the
interpreter's own shutdown (non-daemon threads joined, atexit handlers run, an uncaught exception
printed, exit status 1).

The shim stands for the child in every way its parent can see: it forwards the signals a launcher sends
(SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the child, and exits as the child did: with its
status, or killed by the same signal. A shim killed by SIGKILL (which it cannot forward) closes its
connection, and the server SIGKILLs the child. In the child ``sys.executable`` is the shim, so what it
starts with ``sys.executable`` (torchrun's workers, the contract checker's runs) forks from the server
too. Any other command line (``-c``, a script, other interpreter flags) runs the real interpreter.

What forking does not reproduce: a fresh interpreter's start (tests/e2e/test_launch.py, test_faults.py,
test_bad_input_exits.py and the host, Slurm and Docker tests keep real processes for it), the
environment of the server while it imported the preloaded modules (none of them reads the environment at
import; OMP_NUM_THREADS, read when torch loads OpenMP, is 1 as in every test launch), and the process
tree (the child's parent is the server, not the shim: a test that looks for a launcher's children by
parent pid needs real processes).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRELOADED = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.distributed.run",
    "torch.utils.tensorboard",
    "numpy",
    "ddp_core.experiment",
    "ddp_core.contract",
    "ddp_core.output.figures",
    "experiments.cifar10_data",
    "experiments.cifar10_models",
]
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_LENGTH = struct.Struct("!I")

# The shim: the standard library only, and no site (-S), so that it starts in a few milliseconds.
SHIM = """#!{python} -S
import json, os, signal, socket, struct, sys
REAL, SERVER = {python!r}, {server!r}
def real():
    os.execv(REAL, [REAL, *sys.argv[1:]])
args = sys.argv[1:]
while args[:1] == ["-u"]:
    args = args[1:]
if len(args) < 2 or args[0] != "-m":
    real()
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
    except OSError:  # a standard stream is closed: the real interpreter, which knows what to make of that
        real()
request = json.dumps({{"module": args[1], "argv": args[2:], "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(SERVER)
    socket.send_fds(server, [struct.pack("!I", len(request)) + request], [0, 1, 2])
except OSError:  # no server: the real interpreter does it all
    real()
replies = server.makefile("r")
def reply():
    line = replies.readline()
    if not line:
        sys.exit(f"tests.prefork: the fork server ended before python -m {{args[1]}} did")
    return int(line)
pid = reply()
def forward(number, frame):
    try:
        os.kill(pid, number)
    except ProcessLookupError:  # it has just ended: its status, read next, is what this process mirrors
        pass
for number in {forwarded}:
    signal.signal(number, forward)
status = reply()
if status < 0:
    if -status in {forwarded}:
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status if status >= 0 else 128 - status)
"""


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
        more = connection.recv(1 << 16)
        if not more:
            raise ConnectionError("the shim closed its connection mid-request")
        data += more
    return json.loads(data[_LENGTH.size : _LENGTH.size + _LENGTH.unpack_from(data)[0]]), fds


def serve(socket_path: str, shim: str) -> tuple[dict, list[int]]:
    """The server's loop; returns (only in a forked child) the request the child is to become."""
    for name in PRELOADED:
        importlib.import_module(name)
    gc.freeze()  # the preloaded objects stay out of the children's collections: fewer pages copied on write
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_reader, wake_writer = socket.socketpair()
    wake_writer.setblocking(False)
    signal.set_wakeup_fd(wake_writer.fileno())
    signal.signal(signal.SIGCHLD, lambda number, frame: None)  # a Python handler, so that the wake-up fd is written
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_reader, selectors.EVENT_READ)
    selector.register(
        sys.stdin, selectors.EVENT_READ
    )  # end of file: the pytest process that started this server is gone
    connections: dict[int, socket.socket | None] = {}  # child pid -> its shim's connection (None once the shim is gone)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                try:
                    request, fds = _read_request(connection)
                except (OSError, ValueError):
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for sock in (
                        listener,
                        wake_reader,
                        wake_writer,
                        connection,
                        *(c for c in connections.values() if c),
                    ):
                        sock.close()
                    selector.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                try:
                    connection.sendall(f"{pid}\n".encode())
                except OSError:  # the shim is already gone (its launcher died: PR_SET_PDEATHSIG): so is its process
                    connection.close()
                    connections[pid] = None
                    os.kill(pid, signal.SIGKILL)
                    continue
                connections[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            elif key.fileobj is sys.stdin:
                os._exit(0)
            elif key.fileobj is wake_reader:
                wake_reader.recv(4096)
                _reap(connections, selector)
            else:  # a shim's connection became readable: it never writes after its request, so it is gone
                pid = key.data
                selector.unregister(key.fileobj)
                key.fileobj.close()
                connections[pid] = None
                try:
                    os.kill(pid, signal.SIGKILL)  # its shim was SIGKILLed: so is the process it stood for
                except ProcessLookupError:
                    pass


def _reap(connections: dict[int, socket.socket | None], selector: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = connections.pop(pid, None)
        if connection is not None:
            selector.unregister(connection)
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            connection.close()


def become(request: dict, fds: list[int], shim: str) -> None:
    """Turn this forked child into ``python -m request["module"] *request["argv"]``."""
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read from TMPDIR afresh, as a new interpreter does
    sys.executable = shim
    # python -m puts the working directory first, then PYTHONPATH's entries: the request's, not the server's
    sys.path[: 1 + len(_python_path(_SERVER_ENVIRONMENT))] = [request["cwd"], *_python_path(request["env"])]
    sys.argv = ["-m", *request["argv"]]
    module = request["module"]
    sys.modules.pop(module, None)  # preloaded or not, it runs afresh as __main__, as under python -m
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        runpy._run_module_as_main(module, alter_argv=True)  # what `python -m` itself calls
        status = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # how python itself ends on an uncaught Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    _finish()
    os._exit(status & 0xFF)


def _finish() -> None:
    """The part of the interpreter's shutdown that anything outside the process can see.

    Not the rest: tearing down every module of a forked process whose heap holds torch touches (and so
    copies) most of that heap, 0.85 s of CPU for nothing anyone sees.
    """
    import atexit as exit_handlers
    import threading

    threading._shutdown()  # non-daemon threads are joined first, as at any interpreter's exit
    exit_handlers._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


_SERVER_ENVIRONMENT = dict(os.environ)


def _python_path(environment: dict[str, str]) -> list[str]:
    return [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry]


def main(socket_path: str, shim: str) -> None:
    request, fds = serve(socket_path, shim)
    become(request, fds, shim)


_SHIM_PATH: str | None = None


def python() -> str:
    """The shim's path; the first call starts this process's fork server (stopped when this process exits)."""
    global _SHIM_PATH
    if _SHIM_PATH is None:
        folder = Path(tempfile.mkdtemp(prefix="ddp-lab-prefork-"))
        socket_path, shim = str(folder / "server"), str(folder / "python")
        Path(shim).write_text(
            SHIM.format(python=sys.executable, server=socket_path, forwarded=tuple(int(s) for s in FORWARDED))
        )
        os.chmod(shim, 0o755)
        if not os.access(
            shim, os.X_OK
        ):  # a temporary folder mounted noexec: real interpreters, slower but the same tests
            warnings.warn(
                f"tests.prefork: {folder} does not let the stand-in run (noexec?); the tests start real interpreters"
            )
            _SHIM_PATH = sys.executable
            return _SHIM_PATH
        environment = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        environment.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
        server = subprocess.Popen(
            [sys.executable, "-c", f"import tests.prefork as p; p.main({socket_path!r}, {shim!r})"],
            cwd=REPO,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        ready = server.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(
                f"the fork server did not start (exit {server.wait()}); run tests/prefork.py's main by hand to see why"
            )
        atexit.register(_stop, server, folder)
        _SHIM_PATH = shim
    return _SHIM_PATH


def _stop(server: subprocess.Popen, folder: Path) -> None:
    server.stdin.close()
    server.wait()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
