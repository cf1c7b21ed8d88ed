"""tests.prefork's interpreter behaves as ``python -m`` does, as far as a parent or the process itself can see.

Every case runs tests/unit/prefork_probe.py twice, with ``sys.executable`` and with ``prefork.python()``,
and compares: exit status, standard output, the last line of standard error. Then what only the stand-in
must do: forward a launcher's signal, take its forked process with it when killed, and run anything that
is not ``-m MODULE`` with the real interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import prefork
from tests.e2e.launch import REPO, clean_env

PROBE = "tests.unit.prefork_probe"


def launch(
    python: str, how: str, *, stdin: str | None = None, cwd: Path = REPO, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", PROBE, how],
        cwd=cwd,
        env=clean_env(PROBE="set", **env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def both(how: str, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return launch(sys.executable, how, **kwargs), launch(prefork.python(), how, **kwargs)


@pytest.mark.parametrize(
    "how, status, last_error_line",
    [
        ("show", 0, ""),
        ("exit3", 3, ""),
        ("exit-message", 1, "a message for stderr"),
        ("raise", 1, "ValueError: the probe's uncaught error"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
        ("thread", 0, ""),
        ("sigkill-self", -signal.SIGKILL, ""),
        ("python-child", 0, ""),
    ],
)
def test_an_ending_looks_the_same_from_outside(how: str, status: int, last_error_line: str):
    real, forked = both(how)
    for result in (real, forked):
        assert result.returncode == status, result.stderr[-2000:]
        assert (result.stderr.strip().splitlines() or [""])[-1] == last_error_line, result.stderr[-2000:]
    assert forked.stdout == real.stdout


def test_what_the_process_sees_of_its_start(tmp_path: Path):
    """argv, __main__, the working directory and PYTHONPATH first on sys.path, the environment, stdin."""
    extra = tmp_path / "probe-path"
    real, forked = both("show", cwd=tmp_path, PYTHONPATH=f"{REPO}{os.pathsep}{extra}")
    assert real.returncode == forked.returncode == 0, real.stderr + forked.stderr
    seen = json.loads(forked.stdout.splitlines()[0])
    assert seen == json.loads(real.stdout.splitlines()[0])
    assert seen["argv"] == [str(REPO / "tests" / "unit" / "prefork_probe.py"), "show"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path) and seen["path"] == [str(tmp_path), str(REPO)] and seen["probe"] == "set"
    real, forked = both("stdin", stdin="from the parent")
    assert forked.stdout == real.stdout and "read 'from the parent'" in forked.stdout


def test_a_spawned_worker_sees_what_a_spawned_interpreter_sees(tmp_path: Path):
    """multiprocessing's spawn start (the --nproc path) through the stand-in: the worker's argv, module name, parent
    (its launcher, which ddp_core.process.orphans checks), environment, a sitecustomize on PYTHONPATH, and its exit
    code as the launcher reads it; the same as from real interpreters, and forked, not started afresh."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = str(os.getpid())\n")
    real, forked = both("spawn", PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    seen = []
    for result in (real, forked):
        assert result.returncode == 0, result.stderr[-3000:]
        lines = result.stdout.splitlines()
        assert lines[-2:] == ["worker exited 5", "atexit ran"], result.stdout
        seen.append(json.loads(lines[1]))
    for worker in seen:
        assert worker.pop("site").isdigit()  # sitecustomize ran in the worker itself, at its start
    assert [worker.pop("forked") for worker in seen] == [False, True]  # the stand-in's worker started no interpreter
    probe = str(REPO / "tests" / "unit" / "prefork_probe.py")
    expected = {"argv": [probe, "spawn"], "main": "__mp_main__", "parent_is_launcher": True, "probe": "set"}
    assert seen[0] == seen[1] == expected


def test_a_spawned_worker_dies_with_its_launcher():
    """ddp_core.process.orphans: a launcher killed by SIGKILL leaves no worker. The stand-in of a spawned worker dies
    with the (forked) launcher, and the server then kills the worker it stood for."""
    shim = subprocess.Popen(
        [prefork.python(), "-m", PROBE, "spawn-and-wait"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, text=True
    )
    shim.stdout.readline()  # what the launcher sees of its start
    worker = shim.stdout.readline().split()
    assert worker[0] == "worker", worker
    shim.kill()
    shim.wait(timeout=60)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker[1]}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition: the kernel, then the server, kill the worker
    assert not Path(f"/proc/{worker[1]}").exists()


def test_a_preloaded_module_runs_as_main_without_a_warning():
    """tools.contract is imported by the server already; `-m` runs it afresh, as python would, and quietly."""
    assert "tools.contract" in prefork.PRELOADED
    result = subprocess.run(
        [prefork.python(), "-m", "tools.contract", "--help"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.startswith("usage:") and result.stderr == "", result.stderr


def start_waiting_probe() -> tuple[subprocess.Popen, int]:
    """The forked probe, blocked in signal.pause(); returns the shim and the forked process's pid."""
    shim = subprocess.Popen(
        [prefork.python(), "-m", PROBE, "wait-for-sigterm"],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    shim.stdout.readline()  # what the process sees of its start
    waiting = shim.stdout.readline().split()
    assert waiting[0] == "waiting", waiting
    return shim, int(waiting[1])


def test_a_signal_to_the_stand_in_reaches_the_process_and_its_exit_comes_back():
    shim, pid = start_waiting_probe()
    assert pid != shim.pid  # a forked process, not the shim itself
    assert prefork.stands_for(shim.pid) == pid and prefork.stands_for(os.getpid()) == os.getpid()
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=60) == 7  # the process's own SIGTERM handler chose 7
    assert "atexit ran" in shim.stdout.read()
    assert prefork.stands_for(shim.pid) == shim.pid  # reaped (before its exit reached the shim): no longer named


def test_a_stand_in_killed_outright_takes_its_process_with_it():
    shim, pid = start_waiting_probe()
    shim.kill()
    assert shim.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition: the server SIGKILLs and reaps the forked process
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("arguments", [["-c", "import sys; print(sys.executable)"], ["-O", "-m", PROBE, "exit3"]])
def test_anything_but_dash_m_runs_the_real_interpreter(arguments: list[str]):
    result = subprocess.run(
        [prefork.python(), *arguments], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    if arguments[0] == "-c":
        assert result.returncode == 0 and result.stdout.strip() == sys.executable
    else:
        assert result.returncode == 3


def test_a_closed_standard_stream_falls_back_to_the_real_interpreter():
    """A stream the stand-in cannot pass on (here stdin, closed) leaves the whole run to the real python."""
    result = subprocess.run(
        [prefork.python(), "-m", PROBE, "exit3"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.close(0),
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[0])["stdin"] is None  # as python leaves a closed stdin


def test_a_shim_gone_before_its_pid_is_sent_leaves_the_server_serving():
    """A launcher that dies while it starts workers takes their shims with it (PR_SET_PDEATHSIG): the server's
    reply to such a shim fails, and the server must go on serving the others, not end with that error."""
    socket_path = str(Path(prefork.python()).with_name("server"))
    for _ in range(3):
        request = json.dumps({"module": PROBE, "argv": ["wait-for-sigterm"], "env": clean_env(), "cwd": str(REPO)})
        body = request.encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.connect(socket_path)
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed at once
            socket.send_fds(gone, [struct.pack("!I", len(body)) + body], [0, 1, 2])
    shim, pid = start_waiting_probe()  # the server still forks
    assert pid != shim.pid
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=60) == 7
