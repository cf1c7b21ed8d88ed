"""Faults that must not hurt what is already running or written.

The launches fork from tests/prefork.py's server, torch imported once: a worker to signal is found among its
launcher's children (``prefork.stands_for`` names the launcher's own pid; the workers found are the shims that
stand for them, which forward a signal, and whose SIGKILL kills their worker). The hang's test sees both gone: the
stand-ins the launcher killed, and the processes they stood for."""

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
import torch

from ddp_core.exit_codes import HUNG_EXIT_CODE, STOPPED_EXIT_CODE
from ddp_core.output.checkpoint import load_checkpoint
from ddp_core.process.launch import free_port
from tests import prefork
from tests.e2e.launch import (
    REPO,
    clean_env,
    final_weights,
    run,
    torchrun,
    torchrun_command,
)
from tools import contract_trace


def workers_of(agent_pid: int, module: str = "experiments.toy") -> list[int]:
    """The agent's child processes that run the experiment (torchrun's workers)."""
    children = subprocess.run(
        ["pgrep", "-P", str(prefork.stands_for(agent_pid))], capture_output=True, text=True, check=False
    ).stdout.split()
    return [int(pid) for pid in children if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; a zombie (exited, not yet reaped) does not count."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run_faulty_toy(
    tmp_path: Path, fault: str, nproc: int = 2, steps: str = "200", **env: str
) -> tuple[subprocess.Popen, str, dict[int, int]]:
    """``nproc`` workers of the toy under ddp-lab's launcher, FAULT on rank 1 at step 5; returns the agent, its output
    and its workers: each of the launcher's children (a stand-in) with the process it stood for. ddp_core.torchrun,
    not plain torchrun: it ends a hung rank after TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    command = torchrun_command(
        nproc,
        "tests.e2e.faulty",
        "experiments.toy",
        "--run-dir",
        str(tmp_path / "run"),
        "--steps",
        steps,
        "--dataset-size",
        "256",
        launcher="ddp_core.torchrun",
    )
    agent = subprocess.Popen(
        command,
        cwd=REPO,
        env=clean_env(FAULT=fault, FAULT_RANK="1", FAULT_STEP="5", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while len(workers) < nproc and agent.poll() is None and time.monotonic() < deadline:
            for shim in workers_of(agent.pid, "tests.e2e.faulty"):
                process = prefork.stands_for(shim)
                if process != shim or prefork.python() == sys.executable:  # forked by the server, or a real one
                    workers[shim] = process
            time.sleep(0.05)  # waiting for a condition: every worker started
        output = agent.communicate(timeout=120)[0]  # the deadline: far below torch's 30-minute default
    finally:
        if agent.poll() is None:
            agent.kill()
    return agent, output, workers


def test_a_crash_on_one_rank_is_reported_as_the_root_cause_within_seconds(tmp_path: Path):
    """The others fail too (their peer's connection closes), but the launcher must blame the crashed rank."""
    agent, output, _ = run_faulty_toy(tmp_path, "crash", DIST_TIMEOUT_S="600")  # forked from the prefork server
    assert agent.returncode == 1
    assert "InjectedFault: injected fault on rank 1 at step 5" in output, output[-5000:]
    assert re.search(r"^error: rank 1 \(host .*\) raised InjectedFault", output, re.M), output[-3000:]
    assert "Connection closed by peer" not in output and "PeerExitedError" not in output


def test_a_hung_rank_is_named_with_where_the_others_waited_and_the_job_ends_with_no_worker_left(tmp_path: Path):
    """3 processes, rank 1 hangs in its 5th step: the short timeout (not the long set-up one) ends the job,
    and the line names rank 1 and the collective ranks 0 and 2 waited in; their flight records are in the run."""
    agent, output, workers = run_faulty_toy(
        tmp_path,
        "hang",
        nproc=3,
        DIST_TIMEOUT_S="5",
        DIST_INIT_TIMEOUT_S="900",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3",
    )
    assert agent.returncode == HUNG_EXIT_CODE and len(workers) == 3, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    [line] = re.findall(r"^error: (rank 0: .*)", output, re.M)
    assert line.startswith(
        "rank 0: a collective timed out after 5 seconds (DIST_TIMEOUT_S): rank(s) 1 did not arrive"
    ), line
    assert re.search(r"the others waited: ranks 0, 2 in all_reduce #\d+ \(sizes \[\[\d+\]\]\);", line), line
    assert "flight_recorder_rank_N (docs/faults.md: Finding a hang)" in line
    dumps = sorted(path.name for path in (tmp_path / "run").glob("flight_recorder_rank_*"))
    assert dumps == ["flight_recorder_rank_0", "flight_recorder_rank_2"]  # every rank that could still write
    read = subprocess.run(
        [prefork.python(), "-m", "ddp_core.distributed.flight_recorder", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert read.returncode == 0 and re.findall(r"^rank (\d+): \d+ recorded", read.stdout, re.M) == ["0", "2"], (
        read.stdout + read.stderr
    )
    assert "all_reduce sizes [[1]]" in read.stdout, read.stdout
    # The hung worker was killed, not left behind: the launcher's children (the stand-ins, which die as their
    # processes do) at once, and the processes they stood for (which the suite's server kills as each stand-in dies)
    assert not [pid for pid in workers if alive(pid)]
    deadline = time.monotonic() + 30
    while [pid for pid in workers.values() if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.02)  # polling the processes' state: the condition decides
    assert not [pid for pid in workers.values() if alive(pid)]


def test_a_rank_that_starts_late_waits_under_the_long_timeout_not_the_short_one(tmp_path: Path):
    """Rank 2 comes up 8 s after the others; DIST_TIMEOUT_S=3 applies only after the first step, so the job finishes."""
    agent, output, _ = run_faulty_toy(
        tmp_path, "late", nproc=3, steps="20", FAULT_DELAY_S="8", DIST_TIMEOUT_S="3", DIST_INIT_TIMEOUT_S="120"
    )
    assert agent.returncode == 0, output[-5000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 20


# Long enough that a signal sent after the first checkpoint lands mid-run: 950 steps are left then, about 5 s on 2
# idle cores (the test reacts within 0.1 s; a loaded machine slows the steps as much as the test).
LONG_STEPS = 1000
LONG_TOY = ("--steps", str(LONG_STEPS), "--dataset-size", "512", "--checkpoint-every", "50", "--log-every", "1000")


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run every interrupted one must match bitwise."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), *LONG_TOY)
    return final_weights(run_dir)


def wait_for_first_checkpoint(agent: subprocess.Popen, folder: Path, pattern: str = "checkpoints/last.pt") -> None:
    deadline = time.monotonic() + 120
    while not list(folder.glob(pattern)) and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for a condition: the first checkpoint
    assert agent.poll() is None and list(folder.glob(pattern)), "the run ended (or never started) before the signal"


# A log point every 7 steps, read late as on a GPU: the signal reaches the other rank with a log point's figures
# (before the next checkpoint's own question, 50 steps apart), read at the log point after.
LATE_READS = ("--log-every", "7", "--log-reads", "late")


@pytest.mark.parametrize("reads", [(), LATE_READS], ids=["now", "late"])
def test_a_stop_signal_to_one_worker_checkpoints_at_an_agreed_step_and_the_relaunch_resumes_bitwise(
    tmp_path: Path, reference_weights: dict[str, torch.Tensor], reads: tuple[str, ...]
):
    """SIGTERM (Slurm, a kill) to one worker only: every rank stops after the same step (each rank's trace says which;
    rank 0 alone prints the stop line), rank 0 writes the checkpoint, the job exits 143; relaunching with --resume
    ends bitwise-equal. SIGTERM to torchrun (docker stop) is the contract's sigterm property
    (tests/e2e/test_contract.py)."""
    run_dir, traces = tmp_path / "run", tmp_path / "traces"
    command = [
        prefork.python(),
        "-m",
        "ddp_core.torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        *LONG_TOY,
        *reads,
    ]
    agent = subprocess.Popen(
        command,
        cwd=REPO,
        env=clean_env(**contract_trace.env(traces)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_first_checkpoint(agent, run_dir)
        os.kill(workers_of(agent.pid)[1], signal.SIGTERM)
        output = agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == STOPPED_EXIT_CODE, output[-4000:]
    assert output.strip().splitlines()[-1].startswith("stopped: "), output[-2000:]
    said = re.findall(r"\[rank (\d+)/2\] WARNING stopped by a signal after step (\d+)", output)
    assert len(said) == 1 and said[0][0] == "0", output[-4000:]  # one line, rank 0's
    step = int(said[0][1])
    assert contract_trace.last_steps(traces, run_dir.name) == {
        0: step,
        1: step,
    }  # each rank's own record: the same step
    assert 0 < step < LONG_STEPS and torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == step
    if reads:  # asked only where a checkpoint pauses anyway, or told with a log point's figures read late
        assert step % 50 == 0 or step % 7 == 0, step
    assert not (run_dir / "metrics.json").exists()  # the run has not ended (as CIFAR10 and the template)

    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), "--resume", *LONG_TOY)
    resumed = final_weights(run_dir)
    assert all(torch.equal(reference_weights[key], resumed[key]) for key in reference_weights)


def test_a_killed_worker_is_restarted_and_the_run_resumes_bitwise(
    tmp_path: Path, reference_weights: dict[str, torch.Tensor]
):
    """SIGKILL one worker mid-run under --max-restarts=1: torchrun restarts the group, the restarted
    workers find this job's run directory and its last checkpoint, and the run ends as if never hit. Static
    rendezvous here; a killed worker under standalone rendezvous is in test_resume_world_sizes.py (3 processes, toy
    and CIFAR10) and test_cifar10.py (2)."""
    flags = LONG_TOY
    work = tmp_path / "work"  # no --run-dir: the default runs/toy/<timestamp>, under this folder
    work.mkdir()
    torchrun_args = ("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}")
    agent = subprocess.Popen(
        torchrun_command(2, "experiments.toy", *flags, torchrun_args=(*torchrun_args, "--max-restarts=1")),
        cwd=work,
        env=clean_env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_first_checkpoint(agent, work, "runs/toy/*/checkpoints/last.pt")
        victims = workers_of(agent.pid)
        assert agent.poll() is None and len(victims) == 2, "the run ended (or never started) before the kill"
        os.kill(victims[1], signal.SIGKILL)
        output = agent.communicate(timeout=300)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]
    [run_dir] = list(work.glob("runs/toy/*"))  # the restart continued the same run directory
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["resumed"] is True and manifest["world"]["restart_count"] == 1 and len(manifest["history"]) == 1
    resumed = final_weights(run_dir)
    assert all(torch.equal(reference_weights[key], resumed[key]) for key in reference_weights)


def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one_and_the_resume_is_exact(tmp_path: Path):
    flags = ("--steps", "60", "--dataset-size", "256", "--checkpoint-every", "10")
    reference = tmp_path / "reference"
    torchrun(2, "experiments.toy", "--run-dir", str(reference), *flags)

    run_dir = tmp_path / "run"
    killed = run(
        torchrun_command(2, "tests.e2e.faulty", "experiments.toy", "--run-dir", str(run_dir), *flags),
        FAULT="kill_in_save",
        FAULT_RANK="0",
        FAULT_STEP="3",
    )
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.stderr + killed.stdout
    [leftover] = (run_dir / "checkpoints").glob(".*.tmp-*")  # the half-written third checkpoint
    assert leftover.name.startswith(".step_00000030.pt.tmp-") and leftover.stat().st_size > 0
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 20  # the second one, intact
    for step in (10, 20):  # every earlier checkpoint too: none is deleted before the next one is complete
        assert load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt")["step"] == step

    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), "--resume", *flags)
    assert not list((run_dir / "checkpoints").glob(".*.tmp-*"))  # cleaned up by the next save
    expected, resumed = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)


def test_a_second_job_on_a_busy_port_fails_naming_the_port_and_the_first_goes_on(tmp_path: Path):
    port = free_port()
    first_dir = tmp_path / "first"
    first = subprocess.Popen(
        torchrun_command(
            2,
            "experiments.toy",
            "--run-dir",
            str(first_dir),
            # Training until stopped: a first job that ended while the second was still importing torch (seconds,
            # on a loaded machine) would free the port, and the second would wait for its rank 1 instead.
            *LONG_TOY[2:],
            "--steps",
            "10000000",
            torchrun_args=("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"),
            launcher="ddp_core.torchrun",  # stopped below: exit 143, as plain torchrun's SIGTERM is not
        ),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_first_checkpoint(first, first_dir)  # the first job is training
        second = run(
            [prefork.python(), "-m", "experiments.toy", "--run-dir", str(tmp_path / "second")],
            timeout=60,
            RANK="0",
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DIST_TIMEOUT_S="30",
        )
        assert second.returncode != 0
        assert f"port {port} on 127.0.0.1 is already in use" in second.stderr, second.stderr[-2000:]
        assert not (tmp_path / "second").exists()
        assert first.poll() is None, "the first job ended before the second had tried its port"
        first.send_signal(signal.SIGTERM)  # the first is unharmed: it stops on request, as any run does
        output = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == STOPPED_EXIT_CODE, output[-3000:]
    assert load_checkpoint(first_dir / "checkpoints" / "last.pt")["step"] > 0
