"""A stand-in for ``python`` whose ``-m MODULE`` processes fork from a server that has imported torch already.

    command = [prefork.python(), "-m", "ddp_core.torchrun", "--standalone", "--nproc-per-node=3",
               "-m", "experiments.toy", ...]
    subprocess.run(command, ...)   # as with sys.executable, a second or more of CPU cheaper per process

Every Python process an end-to-end test starts imports torch (about 1.5 s of CPU on the 2-core machine)
and, if it wraps a model in DDP, ``torch._dynamo`` (about 0.85 s more): most of the suite's CPU time is
that start-up, repeated in hundreds of processes (docs/benchmarks.md, "Test suite time without Docker
and Slurm"). ``python()`` returns the path of a small executable script, the *shim*, that a test uses in
place of ``sys.executable``. Run as ``shim [-u] [-B] -m MODULE ARGS...`` it sends its argument list,
environment, working directory and standard streams to this pytest process's *fork server*, which
imported torch (and the rest of ``PRELOADED``) once; the server forks, and the child becomes
``python -m MODULE ARGS...``: the same streams, environment and directory, ``sys.argv`` and ``__main__``
as ``python -m`` makes them, ``sitecustomize`` imported if the request's PYTHONPATH has one, its own
session (as torchrun starts its workers), and on exit the interpreter's own shutdown (non-daemon threads
joined, atexit handlers run, an uncaught exception printed, exit status 1). The command line that
``multiprocessing``'s spawn start runs (``-c "...spawn_main(tracker_fd=N, pipe_handle=M)"
--multiprocessing-fork``: the ``--nproc`` path's workers) is served the same way, its two descriptors passed
on under their numbers, so a child forked here spawns through the shim too.

The shim stands for the child in every way its parent can see: it forwards the signals a launcher sends
(SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the child, and exits as the child did: with its
status, or killed by the same signal. A shim killed by SIGKILL (which it cannot forward) closes its
connection, and the server SIGKILLs the child. In the child ``sys.executable`` is the shim, so what it
starts with ``sys.executable`` or spawns (torchrun's workers, the contract checker's runs, ``--nproc``'s
workers) forks from the server too. Any other command line (another ``-c``, a script, other interpreter
flags) runs the real interpreter.

What forking does not reproduce: a fresh interpreter's start (tests/e2e/test_launch.py, test_faults.py,
test_bad_input_exits.py and the host, Slurm and Docker tests keep real processes for it), the
environment of the server while it imported the preloaded modules (none of them reads the environment at
import; OMP_NUM_THREADS, read when torch loads OpenMP, is 1 as in every test launch), and the process
tree: the child's parent is the server, not the shim. Every torchrun forked here names its rendezvous events'
callers from the frame (``rendezvous_events_name_their_caller_cheaply``), not with ``inspect.stack()``, which the
preloaded modules make three times as slow as in a real torchrun. A test that looks for a launcher's children by parent
pid asks ``stands_for(shim's pid)`` for the launcher's own; the children it finds there are shims, which
forward signals, and whose death by SIGKILL is their process's. One that must see every process of a job
gone needs real ones. Under ``--max-restarts`` ddp_core.torchrun's warm parent (ddp_core/process/warm.py) is a
child of this server too, its listening socket passed as its standard input; a restarted worker is the warm
parent's own fork, and the launcher's child found for it stands for its thin client, which forwards in turn.
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import importlib
import json
import multiprocessing.spawn
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
    "tools.contract",
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
SPAWN_MAIN = "from multiprocessing.spawn import spawn_main; spawn_main("
def real():
    os.execv(REAL, [REAL, *sys.argv[1:]])
args = sys.argv[1:]
while args[:1] in (["-u"], ["-B"]):
    args = args[1:]
spawn = None  # multiprocessing's spawn start: -c "...spawn_main(tracker_fd=5, pipe_handle=7)" --multiprocessing-fork
if len(args) == 3 and args[0] == "-c" and args[1].startswith(SPAWN_MAIN) and args[2] == "--multiprocessing-fork":
    try:
        spawn = {{k: int(v) for k, v in (item.split("=") for item in args[1][len(SPAWN_MAIN):-1].split(", "))}}
    except ValueError:
        real()
elif len(args) < 2 or args[0] != "-m":
    real()
fds = [0, 1, 2, *(spawn or {{}}).values()]
for fd in fds:
    try:
        os.fstat(fd)
    except OSError:  # a standard stream is closed: the real interpreter, which knows what to make of that
        real()
request = {{"env": dict(os.environ), "cwd": os.getcwd()}}
if spawn:  # a spawned worker dies with its launcher (ddp_core.process.orphans): this stand-in does, and says who
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    request.update(spawn=spawn, parent=os.getppid())
else:
    request.update(module=args[1], argv=args[2:])
    launcher = os.environ.get("DDP_LAB_LAUNCHER_PID", "")
    if launcher.isdigit():  # ddp_core.torchrun's worker dies with it (ddp_core.process.orphans): its stand-in does
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != int(launcher):  # the launcher died before the request
            os.kill(os.getpid(), signal.SIGKILL)
request = json.dumps(request).encode()
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(SERVER)
    signal.pthread_sigmask(signal.SIG_BLOCK, {forwarded})  # a signal sent before the pid is known waits for it
    socket.send_fds(server, [struct.pack("!I", len(request)) + request], fds)
except OSError:  # no server: the real interpreter does it all
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {forwarded})
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
signal.pthread_sigmask(signal.SIG_UNBLOCK, {forwarded})
status = reply()
if status < 0:
    if -status in {forwarded}:
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status if status >= 0 else 128 - status)
"""


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 8)
    while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
        more = connection.recv(1 << 16)
        if not more:
            raise ConnectionError("the shim closed its connection mid-request")
        data += more
    return json.loads(data[_LENGTH.size : _LENGTH.size + _LENGTH.unpack_from(data)[0]]), fds


def rendezvous_events_name_their_caller_cheaply() -> None:
    """In this server's children only (test infrastructure, not ddp-lab): torch's rendezvous names the caller of each
    event it records with ``inspect.stack()``, which reads every frame's source file and searches ``sys.modules`` for
    its module: with every module of the suite loaded, about 0.7 s a launch, half of a one-step toy run's. The same
    name from the frame itself. ddp-lab's launcher leaves torch's as it is (docs/decisions.md)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        frame = sys._getframe(0)  # inspect.stack()[0], as in torch's
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                return "no_method_name"
        return frame.f_code.co_name

    dynamic_rendezvous.get_method_name = get_method_name


def serve(socket_path: str, shim: str) -> tuple[dict, list[int]]:
    """The server's loop; returns (only in a forked child) the request the child is to become."""
    for name in PRELOADED:
        importlib.import_module(name)
    rendezvous_events_name_their_caller_cheaply()
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
    shims: dict[int, Path] = {}  # child pid -> the file that names it as its shim's (stands_for)
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
                named_reader, named_writer = os.pipe()  # the child runs once the file naming it is written
                pid = os.fork()
                if pid == 0:
                    os.close(named_writer)
                    os.read(named_reader, 1)
                    os.close(named_reader)
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
                shims[pid] = _stands_for(socket_path, _peer_pid(connection))
                written = shims[pid].with_suffix(".new")
                written.write_text(str(pid))
                written.replace(shims[pid])  # whole, and before the shim hears its pid: its parent may ask from then on
                os.close(named_reader)
                os.write(named_writer, b"x")  # and before the child runs: a test that hears from it may ask too
                os.close(named_writer)
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
                _reap(connections, shims, selector)
            else:  # a shim's connection became readable: it never writes after its request, so it is gone
                pid = key.data
                selector.unregister(key.fileobj)
                key.fileobj.close()
                connections[pid] = None
                try:
                    os.kill(pid, signal.SIGKILL)  # its shim was SIGKILLed: so is the process it stood for
                except ProcessLookupError:
                    pass


def _reap(
    connections: dict[int, socket.socket | None], shims: dict[int, Path], selector: selectors.BaseSelector
) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        shims.pop(pid).unlink(missing_ok=True)
        connection = connections.pop(pid, None)
        if connection is not None:
            selector.unregister(connection)
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            connection.close()


def _peer_pid(connection: socket.socket) -> int:
    """The pid of the shim at the other end of ``connection`` (the kernel's word, SO_PEERCRED)."""
    return struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]


def _stands_for(socket_path: str, shim_pid: int) -> Path:
    return Path(socket_path).with_name(f"stands-for-{shim_pid}")


def stands_for(pid: int) -> int:
    """The pid of the process that the shim ``pid`` stands for, or ``pid`` itself where it is no shim of this
    session's server (a real interpreter): what a test that looks for a launcher's children by parent pid needs."""
    if _SHIM_PATH is None or _SHIM_PATH == sys.executable:
        return pid
    try:
        return int(_stands_for(str(Path(_SHIM_PATH).with_name("server")), pid).read_text())
    except FileNotFoundError:
        return pid


def become(request: dict, fds: list[int], shim: str) -> None:
    """Turn this forked child into ``python -m request["module"] *request["argv"]``, or into the worker that
    ``multiprocessing``'s spawn start asked for (``request["spawn"]``: its file descriptors by name)."""
    import runpy

    spawn = request.get("spawn") or {}
    _place(fds, [0, 1, 2, *spawn.values()])
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read from TMPDIR afresh, as a new interpreter does
    sys.executable = shim
    multiprocessing.spawn.set_executable(shim)  # its spawned processes fork from here too
    # python -m puts the working directory first (-c: ''), then PYTHONPATH's entries: the request's, not the server's
    sys.path[: 1 + len(_python_path(_SERVER_ENVIRONMENT))] = [
        "" if spawn else request["cwd"],
        *_python_path(request["env"]),
    ]
    sys.modules["__main__"] = types.ModuleType("__main__")
    if spawn:  # its parent is the launcher that spawned it, as for a spawned process (the shim dies with it)
        parent = request["parent"]
        os.getppid = lambda: parent
    try:
        _run_sitecustomize()
        if spawn:
            sys.argv = ["-c", "--multiprocessing-fork"]
            multiprocessing.spawn.spawn_main(**spawn)  # reads the process object from its pipe, runs it, exits
        sys.argv = ["-m", *request["argv"]]
        module = request["module"]
        sys.modules.pop(module, None)  # preloaded or not, it runs afresh as __main__, as under python -m
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


def _place(fds: list[int], targets: list[int]) -> None:
    """Give each received descriptor its number in the requesting process (0-2, then what spawn named).

    Moved above every target first, so that placing one never closes another not yet placed."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
        os.close(fd)


def _run_sitecustomize() -> None:
    """What ``site`` does as an interpreter starts: import ``sitecustomize`` if the (request's) path has one, and
    say so if it fails. The server's own import, if any, does not count: a new interpreter would run it again."""
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
    except Exception as error:
        print(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(error).__name__}: {error}",
            file=sys.stderr,
        )


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
