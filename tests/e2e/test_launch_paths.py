"""Launch paths agree: ddp_core.torchrun and ``--nproc`` give their workers the same threads, and a launcher
killed by SIGKILL leaves no worker behind.

Real interpreters (``sys.executable``), not tests.prefork's: the threads are read by torch when it loads
OpenMP, and the workers must be the launcher's own children.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core.process import timeline
from tests.e2e.launch import REPO, clean_env

TORCHRUN = (sys.executable, "-m", "ddp_core.torchrun", "--standalone", "--nproc-per-node=2")
LAUNCHERS = {
    "ddp_core.torchrun": lambda module, *args: [*TORCHRUN, "-m", module, *args],
    "--nproc": lambda module, *args: [sys.executable, "-m", module, "--nproc", "2", *args],
}
GONE_WITHIN_S = 15  # a killed launcher's workers stop within seconds


def environment(omp_num_threads: str | None) -> dict[str, str]:
    env = clean_env()  # sets OMP_NUM_THREADS=1 for every other test launch: here it is what is tested
    del env["OMP_NUM_THREADS"]
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = omp_num_threads
    return env


def threads_of_one_process(omp_num_threads: str) -> int:
    """torch's intra-op threads in a process started with this OMP_NUM_THREADS (torch caps it at the cores)."""
    command = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.check_output(command, env=environment(omp_num_threads), text=True, timeout=60))


def test_both_launchers_keep_the_threads_the_user_set(tmp_path: Path):
    """torchrun's rule (torch.distributed.run): with several processes on the node and no OMP_NUM_THREADS,
    each worker gets OMP_NUM_THREADS=1 (test_a_launcher_killed_by_sigkill_leaves_no_worker_alive's hung workers
    report it); a value the user set is kept. The --nproc workers got every core."""
    omp_num_threads = "2"
    seen = {}
    for name, command in LAUNCHERS.items():
        out = tmp_path / name
        out.mkdir()
        result = subprocess.run(
            command("tests.e2e.threads_probe", "--out", str(out)),
            cwd=REPO,
            env=environment(omp_num_threads),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{name}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        seen[name] = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))}
    each = {"OMP_NUM_THREADS": omp_num_threads, "threads": threads_of_one_process(omp_num_threads)}
    assert seen == {name: {"rank0": each, "rank1": each} for name in LAUNCHERS}


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, parent = text.rsplit(")", 1)[1].split()[:2]
    return int(parent), state


def descendants(pid: int) -> set[int]:
    found, parents = set(), {pid}
    while parents:
        children = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[0] in parents:
                children.add(int(entry.name))
        children -= found
        found |= children
        parents = children
    return found


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")  # a zombie has stopped: only its exit status is left


def omp_num_threads_of(pid: int) -> str | None:
    """The variable as the process started with it (what OpenMP read)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    values = [entry.split(b"=", 1)[1].decode() for entry in entries if entry.startswith(b"OMP_NUM_THREADS=")]
    return values[0] if values else None


def kill_what_is_left(process: subprocess.Popen, workers: set[int]) -> None:
    """A failed test's clean-up: the launcher and any worker still alive."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in workers:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)  # polling a condition, not waiting for a guessed time


WORKLOADS = {
    # the toy training for ever, ready once it has logged a step
    "training": (
        ("experiments.toy", "--steps", "100000000", "--log-every", "10", "--checkpoint-every", "100000000"),
        lambda out, log: re.search(r"step \d+/100000000", log.read_text()) is not None,
    ),
    # ranks hung inside torch: a stop signal (torch.multiprocessing's SIGINT on its parent's death) never acts
    "hung": (("tests.e2e.hang_probe",), lambda out, log: len(list(out.glob("rank*.ready"))) == 2),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_launcher_killed_by_sigkill_leaves_no_worker_alive(tmp_path: Path, launcher: str, workload: str):
    """kill -9 of the launcher (or the out-of-memory killer): its workers, which hold the port and the GPUs,
    must not train on as orphans, nor hang on. They are killed within seconds."""
    log, out = tmp_path / "output.log", tmp_path / "out"
    out.mkdir()
    arguments, ready = WORKLOADS[workload]
    command = LAUNCHERS[launcher](*arguments, "--run-dir" if workload == "training" else "--out", str(out))
    workers: set[int] = set()
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=environment(None), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:

        def started() -> bool:
            assert process.poll() is None, f"the launcher ended ({process.returncode}):\n{log.read_text()[-3000:]}"
            return ready(out, log)

        wait_for(started, 180, f"the workers' {workload}")
        workers = descendants(process.pid)
        ranks = [pid for pid in workers if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 2, workers
        # Both launchers give every worker torchrun's one thread per process (OMP_NUM_THREADS unset here).
        assert [omp_num_threads_of(pid) for pid in ranks] == ["1", "1"], ranks
        if workload == "hung":  # and torch took it: one intra-op thread
            given = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.ready"))]
            assert given == [{"OMP_NUM_THREADS": "1", "threads": 1}] * 2, given
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in workers), GONE_WITHIN_S, f"workers {sorted(workers)} to stop")
    finally:
        kill_what_is_left(process, workers)


def test_a_launcher_killed_by_sigkill_after_a_fast_restart_leaves_nothing_alive(tmp_path: Path):
    """Under --max-restarts the restarted workers are children of the warm parent (ddp_core/process/warm.py), each
    with a thin client as the launcher's child: kill -9 of the launcher takes the parent, its workers and the
    clients with it."""
    events = tmp_path / "timeline"
    command = [*TORCHRUN, "--max-restarts=1", "-m", "tests.e2e.faulty", *WORKLOADS["training"][0]]
    env = {**environment("1"), "FAULT": "sigkill", "FAULT_RANK": "1", "FAULT_STEP": "5", timeline.VARIABLE: str(events)}
    with (tmp_path / "output.log").open("w") as output:
        process = subprocess.Popen(
            [*command, "--run-dir", str(tmp_path / "run")],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    workers: set[int] = set()
    try:

        def forked() -> list[dict]:
            assert process.poll() is None, (tmp_path / "output.log").read_text()[-3000:]
            return [event for event in timeline.read(events) if event["event"] == "warm"]

        wait_for(lambda: len(forked()) == 2, 180, "the restarted workers")
        workers = descendants(process.pid)
        parents = {event["parent"] for event in forked()}
        assert {event["pid"] for event in forked()} | parents <= workers and len(parents) == 1, workers
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in workers), GONE_WITHIN_S, f"{sorted(workers)} to stop")
    finally:
        kill_what_is_left(process, workers)
