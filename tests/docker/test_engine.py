"""The image and compose files with a real Docker engine (CPU, gloo): what users run on their hosts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddp_core.exit_codes import HUNG_EXIT_CODE, STOPPED_EXIT_CODE
from ddp_core.process.launch import free_port
from tests.docker.conftest import find_compose_commands, require_tool
from tests.docker.engine import (
    build_image,
    copy_build_context,
    docker,
    engine_available,
    standin_base_image,
    temporary_network,
)
from tests.e2e.launch import final_weights, torchrun

pytestmark = pytest.mark.docker
TAG = f"ddp-lab:test-{os.getpid()}"
SECRET = "do-not-ship-this-token"
TOY = ("--steps", "5", "--dataset-size", "256")


@pytest.fixture(scope="module")
def base_image() -> str:
    require_tool("a running Docker engine (dockerd)", engine_available())
    require_tool("mmdebstrap (to build the stand-in base image)", shutil.which("mmdebstrap") is not None)
    return standin_base_image()


@pytest.fixture(scope="module")
def context(base_image: str, tmp_path_factory) -> Path:
    """A copy of the build context with a .env holding a secret, built into TAG."""
    context = copy_build_context(tmp_path_factory.mktemp("context"))
    (context / ".env").write_text(f"API_TOKEN={SECRET}\n")
    build_image(context, TAG, base_image)
    yield context
    docker("rmi", "-f", TAG, check=False)


def test_the_image_runs_as_a_user_and_holds_no_secret(context: Path):
    assert docker("run", "--rm", "--entrypoint", "id", TAG, "-u").stdout.strip() == "1000"
    listing = docker("run", "--rm", "--entrypoint", "ls", TAG, "-A", "/app").stdout.split()
    assert sorted(listing) == ["data", "ddp_core", "experiments", "requirements.txt", "runs", "tools"]
    found = docker("run", "--rm", "--entrypoint", "grep", TAG, "-rl", SECRET, "/app", "/tmp", check=False)
    assert found.returncode == 1 and found.stdout == ""  # grep: 1 = nothing found
    assert SECRET not in docker("image", "inspect", TAG).stdout


def test_a_code_change_reuses_the_dependency_layer(context: Path, base_image: str):
    with open(context / "ddp_core" / "__init__.py", "a") as handle:
        handle.write(f"# a code-only change {time.time_ns()}\n")  # unique: never in the build cache yet
    rebuilt = build_image(context, f"{TAG}-changed", base_image)
    try:
        log = rebuilt.stdout + rebuilt.stderr
        pip_step = re.search(r"^#(\d+) \[[^\]]+\] RUN python3 -m pip install", log, re.MULTILINE)
        assert pip_step, log[-3000:]
        assert re.search(rf"^#{pip_step.group(1)} CACHED", log, re.MULTILINE), log[-3000:]
        copy_step = re.search(r"^#(\d+) \[[^\]]+\] COPY ddp_core", log, re.MULTILINE)
        assert copy_step and not re.search(
            rf"^#{copy_step.group(1)} CACHED", log, re.MULTILINE
        )  # the code was copied anew
    finally:
        docker("rmi", "-f", f"{TAG}-changed", check=False)


def test_collectives_demo_passes_in_a_container(context: Path):
    result = docker(
        "run", "--rm", "-e", "EXPERIMENT=collectives", "-e", "NPROC_PER_NODE=2", TAG, check=False, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.split("Summary:")[1].strip().splitlines()
    assert len(summary) >= 12 and all(line.split()[1] == "ok" for line in summary), summary


def compose(
    command: list[str], context: Path, project: str, *args: str, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "IMAGE": TAG, **env}
    return subprocess.run(
        [*command, "-p", project, *args], cwd=context, env=full_env, capture_output=True, text=True, timeout=timeout
    )


COMPOSES = find_compose_commands() or [None]


@pytest.fixture(
    scope="module", params=COMPOSES, ids=lambda c: "none" if c is None else ("v1" if c == ["docker-compose"] else "v2")
)
def compose_command(request, compose_commands) -> list[str]:
    """Each Compose found in turn: the same steps must work with v2 (users) and Debian's v1.29 (CI)."""
    return request.param


@pytest.fixture(scope="module")
def compose_run(context: Path, compose_command: list[str], tmp_path_factory) -> Path:
    """The CPU trainer through compose, as user 4321, writing into a host folder."""
    runs = tmp_path_factory.mktemp("runs")
    os.chown(runs, 4321, 4321)
    project, env = (
        f"ddplab{os.getpid()}{len(compose_command)}",
        {"RUNS_VOLUME": str(runs), "DATA_VOLUME": str(runs), "UID": "4321", "GID": "4321"},
    )
    try:
        result = compose(
            compose_command,
            context,
            project,
            "--profile",
            "cpu",
            "run",
            "--rm",
            "trainer-cpu",
            *TOY,
            RUN_DIR="runs/toy/compose",
            **env,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        yield runs / "toy" / "compose"
    finally:
        compose(compose_command, context, project, "--profile", "cpu", "down", **env)  # its network


def test_cpu_trainer_through_compose_leaves_the_run_directory_owned_by_the_user(compose_run: Path):
    manifest = json.loads((compose_run / "manifest.json").read_text())
    assert manifest["world"]["world_size"] == 2 and manifest["world"]["backend"] == "gloo"
    assert json.loads((compose_run / "metrics.json").read_text())["steps"] == 5
    files = [
        compose_run / "manifest.json",
        compose_run / "metrics.json",
        compose_run / "checkpoints" / "last.pt",
        *compose_run.glob("events.out.tfevents.*"),
    ]
    assert len(files) == 4
    assert {(f.stat().st_uid, f.stat().st_gid) for f in files} == {(4321, 4321)}


def test_tensorboard_service_serves_the_runs_scalars(context: Path, compose_command: list[str], compose_run: Path):
    project, port = f"ddplabtb{os.getpid()}", free_port()
    env = {"RUNS_VOLUME": str(compose_run.parents[1]), "TENSORBOARD_PORT": str(port), "UID": "4321", "GID": "4321"}
    started = compose(compose_command, context, project, "up", "-d", "tensorboard", **env)
    assert started.returncode == 0, started.stderr
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
        deadline, tags = time.monotonic() + 120, None
        while time.monotonic() < deadline and tags is None:  # wait until the server answers, not a fixed time
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    tags = json.loads(response.read())
            except OSError:
                time.sleep(0.5)
        assert tags is not None, compose(compose_command, context, project, "logs", **env).stdout[-3000:]
        assert "train/loss" in tags["toy/compose"]
    finally:
        compose(compose_command, context, project, "down", **env)


@contextlib.contextmanager
def started_nodes(
    network: str,
    nodes: list[list[str]],
    args: tuple[str, ...] = (*TOY, "--run-dir", "/tmp/run"),
    docker_args: tuple[str, ...] = (),
) -> Iterator[list[str]]:
    """One detached container per node (its environment as KEY=VALUE items); removed on the way out."""
    names = []
    try:
        for index, env in enumerate(nodes):
            name = f"{network}-node{index}"
            names.append(name)
            flags = [part for item in env for part in ("-e", item)]
            docker("run", "-d", "--name", name, "--network", network, *docker_args, *flags, TAG, *args)
        yield names
    finally:
        for name in names:
            docker("rm", "-f", name, check=False)


def wait_for_exit(names: list[str], timeout: float = 150) -> list[tuple[int, str]]:
    """Each container's exit code and log."""
    outcomes = []
    for name in names:
        try:
            code = int(docker("wait", name, timeout=timeout).stdout.strip())
        except subprocess.TimeoutExpired:
            logs = {n: docker("logs", n, check=False) for n in names}
            raise AssertionError(
                f"{name} still running after {timeout} s:\n"
                + "\n".join(f"== {n}\n{r.stdout[-2000:]}{r.stderr[-2000:]}" for n, r in logs.items())
            ) from None
        logs = docker("logs", name, check=False)
        outcomes.append((code, logs.stdout + logs.stderr))
    return outcomes


def run_nodes(network: str, nodes: list[list[str]], timeout: float = 150) -> list[tuple[int, str]]:
    with started_nodes(network, nodes) as names:
        return wait_for_exit(names, timeout)


def wait_for_file(container: str, path: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while docker("exec", container, "test", "-f", path, check=False).returncode != 0:
        assert time.monotonic() < deadline, (
            f"no {path} in {container} after {timeout} s: " + docker("logs", container, check=False).stderr[-3000:]
        )
        time.sleep(0.2)  # waiting for a condition: the file


def checkpoint_of(container: str, tmp_path: Path, path: str = "/tmp/run/checkpoints/last.pt") -> dict:
    docker("cp", f"{container}:{path}", str(tmp_path / "last.pt"))
    return torch.load(tmp_path / "last.pt", weights_only=True)


KILL_WORKERS = (
    "import os, signal; [os.kill(int(p), signal.SIGKILL) for p in os.listdir('/proc') if p.isdigit()"
    " and b'experiments.' in open(f'/proc/{p}/cmdline', 'rb').read()"
    " and b'ddp_core.torchrun' not in open(f'/proc/{p}/cmdline', 'rb').read()]"
)


@pytest.fixture
def network(context: Path):  # after the image: the containers on it need one
    with temporary_network("ddplab-net") as name:
        yield name


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_containers_run_a_two_node_job(network: str, rendezvous: str):
    common = [
        "NNODES=2",
        f"MASTER_ADDR={network}-node0",
        "NPROC_PER_NODE=1",
        f"RDZV_BACKEND={rendezvous}",
        "DIST_INIT_TIMEOUT_S=60",
    ]
    outcomes = run_nodes(network, [common + ["NODE_RANK=0"], common + ["NODE_RANK=1"]])
    assert [code for code, _ in outcomes] == [0, 0], "\n\n".join(log[-3000:] for _, log in outcomes)


def test_a_node_whose_peer_never_starts_fails_within_its_timeout(network: str):
    env = ["NNODES=2", "NODE_RANK=0", f"MASTER_ADDR={network}-node0", "NPROC_PER_NODE=1", "DIST_INIT_TIMEOUT_S=10"]
    [(code, log)] = run_nodes(network, [env])
    assert code != 0
    # The roll call names the node that never came, by its --node-rank, and the node that did.
    line = (
        f"error: node 1 (--node-rank=1) never joined the rendezvous at {network}-node0:29500"
        " within 10 seconds (joined: node 0 ("
    )
    assert line in log, log[-3000:]


# Long enough that the signal, sent after the first checkpoint, lands mid-run.
LONG_TOY = (
    "--steps",
    "1500",
    "--dataset-size",
    "512",
    "--checkpoint-every",
    "50",
    "--log-every",
    "1000",
    "--run-dir",
    "/tmp/run",
)


@pytest.fixture(scope="module")
def uninterrupted_toy(tmp_path_factory) -> dict[str, torch.Tensor]:
    """LONG_TOY's final weights, uninterrupted, two processes on this machine (the same for both rendezvous)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    torchrun(2, "experiments.toy", *LONG_TOY[:-1], str(run_dir))
    return final_weights(run_dir)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_nodes_killed_workers_are_restarted_and_the_job_resumes_bitwise(
    network: str, rendezvous: str, tmp_path: Path, uninterrupted_toy: dict[str, torch.Tensor]
):
    """Both nodes mount one runs folder, as hosts share storage: under c10d the restart may put rank 0
    on the other node, which must then find the checkpoint (without it, the job refuses to start over)."""
    shared = tmp_path / "shared-runs"
    shared.mkdir()
    os.chown(shared, 1000, 1000)
    common = [
        "NNODES=2",
        f"MASTER_ADDR={network}-node0",
        "NPROC_PER_NODE=1",
        f"RDZV_BACKEND={rendezvous}",
        "DIST_INIT_TIMEOUT_S=60",
        "MAX_RESTARTS=1",
    ]
    args = (*LONG_TOY[:-1], "runs/job")
    with started_nodes(
        network, [common + ["NODE_RANK=0"], common + ["NODE_RANK=1"]], args, ("-v", f"{shared}:/app/runs")
    ) as (node0, node1):
        deadline = time.monotonic() + 120
        while not (shared / "job" / "checkpoints" / "last.pt").exists():
            assert time.monotonic() < deadline, docker("logs", node0, check=False).stderr[-3000:]
            time.sleep(0.2)  # waiting for a condition: the first checkpoint
        docker("exec", node1, "python3", "-c", KILL_WORKERS)  # every worker of node 1, not its torchrun
        outcomes = wait_for_exit([node0, node1], timeout=300)
        assert [code for code, _ in outcomes] == [0, 0], "\n\n".join(log[-3000:] for _, log in outcomes)
    manifest = json.loads((shared / "job" / "manifest.json").read_text())
    assert manifest["resumed"] is True and manifest["world"]["attempt"] == 2
    resumed = final_weights(shared / "job")
    assert all(torch.equal(uninterrupted_toy[key], resumed[key]) for key in uninterrupted_toy)


def test_docker_stop_checkpoints_and_exits_with_the_stopped_code(context: Path, tmp_path: Path):
    """`docker stop` sends SIGTERM to torchrun (the entrypoint execs it): the workers checkpoint, exit 143."""
    name = f"ddplab-stop-{os.getpid()}"
    try:
        docker("run", "-d", "--name", name, "-e", "NPROC_PER_NODE=2", TAG, "--steps", "100000", *LONG_TOY[2:])
        wait_for_file(name, "/tmp/run/checkpoints/last.pt")
        docker("stop", "-t", "60", name, timeout=120)
        assert int(docker("wait", name).stdout.strip()) == STOPPED_EXIT_CODE
        log = docker("logs", name, check=False)
        assert "stopped: torchrun got SIGTERM" in log.stderr, log.stderr[-3000:]
        checkpoint = checkpoint_of(name, tmp_path)
        assert 50 <= checkpoint["step"] < 100000
    finally:
        docker("rm", "-f", name, check=False)


# The faults that happen most on real clusters, made from outside as they come: the kernel's SIGKILL (the
# out-of-memory killer) and a rank that stops answering (SIGSTOP: it holds its collectives' peers waiting).
SIGNAL_RANK_1 = (
    "import os, signal, sys; [os.kill(int(p), getattr(signal, sys.argv[1])) for p in os.listdir('/proc')"
    " if p.isdigit() and b'experiments.' in open(f'/proc/{p}/cmdline', 'rb').read()"
    " and b'\\0RANK=1\\0' in b'\\0' + open(f'/proc/{p}/environ', 'rb').read()]"
)
COMPOSE_FAULTS = {  # fault: (signal, exit code, what names rank 1)
    "killed": ("SIGKILL", 137, "error: rank 1 (host "),
    "hang": ("SIGSTOP", HUNG_EXIT_CODE, "rank(s) 1 did not arrive"),
}
COMPOSE_DIST_TIMEOUT_S = 10


@pytest.mark.parametrize("fault", COMPOSE_FAULTS)
def test_a_fault_under_compose_is_one_report_with_its_stated_exit_code(
    context: Path, compose_commands: list[list[str]], tmp_path: Path, fault: str
):
    """`compose run trainer-cpu` at 3 processes, rank 1 hit from outside after the first checkpoint: the same
    report and exit code as the launcher gives outside Docker (tests/e2e/test_fault_reports.py), from inside
    the container (its torchrun is PID 1), with no ChildFailedError text and the hang within its timeout."""
    sig, code, names_rank = COMPOSE_FAULTS[fault]
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chown(runs, 4321, 4321)
    project, name = f"ddplabfault{os.getpid()}", f"ddplab-fault-{fault}-{os.getpid()}"
    env = {
        **os.environ,
        "IMAGE": TAG,
        "RUNS_VOLUME": str(runs),
        "DATA_VOLUME": str(runs),
        "UID": "4321",
        "GID": "4321",
        "NPROC_PER_NODE": "3",
        "DIST_TIMEOUT_S": str(COMPOSE_DIST_TIMEOUT_S),
        "RUN_DIR": "runs/fault",
    }
    command = [*compose_commands[0], "-p", project, "--profile", "cpu", "run", "--rm", "--name", name, "trainer-cpu"]
    job = subprocess.Popen(
        [*command, *LONG_TOY[:-2], "--steps", "100000"],
        cwd=context,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (runs / "fault" / "checkpoints" / "last.pt").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=60)[0][-3000:]
            time.sleep(0.2)  # waiting for a condition: the first checkpoint
        docker("exec", name, "python3", "-c", SIGNAL_RANK_1, sig)
        hit = time.monotonic()
        output = job.communicate(timeout=180)[0]
        took = time.monotonic() - hit
    finally:
        if job.poll() is None:
            docker("rm", "-f", name, check=False)
            job.kill()
            job.wait()
        subprocess.run([*compose_commands[0], "-p", project, "down"], cwd=context, env=env, capture_output=True)
    assert job.returncode == code, output[-4000:]
    assert "ChildFailedError" not in output and "Root Cause" not in output, output[-4000:]
    own = [line for line in output.splitlines() if line.strip() and not re.match(r"^\d\d:\d\d:\d\d \[rank ", line)]
    own = [line for line in own if not line.startswith(("W1", "Creating", "Pulling"))]  # torch's thread note, compose
    assert any(names_rank in line for line in own) and len([line for line in own if "error" in line]) <= 2, own
    assert list(runs.glob("fault/failure_node*.txt")), "torch's full output is kept in the run directory"
    if fault == "hang":
        assert took < COMPOSE_DIST_TIMEOUT_S + 15, took
        assert "flight recorder: /app/runs/fault/flight_recorder_rank_0" in output, output[-3000:]
