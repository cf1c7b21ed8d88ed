"""Launching: the collectives demo, bad environments, two torchrun agents as two nodes, restarts.

The launches fork from tests/prefork.py's server (torch imported once), where a fresh interpreter's start is
not what a test checks: the collectives demo under torchrun, one bad environment, an unknown flag and the world
of one without torchrun start real interpreters, so that a start from nothing stays covered here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_core.process.launch import free_port
from tests import prefork
from tests.e2e.launch import REPO, clean_env, run, torchrun, torchrun_command


def test_collectives_demo_passes_on_three_ranks():
    result = torchrun(3, "experiments.collectives", python=sys.executable)
    summary = result.stdout.split("Summary:")[1].strip().splitlines()
    from experiments.collectives import DEMOS

    assert [line.split()[0] for line in summary] == list(DEMOS)
    assert all(line.split()[1] == "ok" for line in summary), summary
    # printed in rank order, like the DDP tutorials' outputs
    gathered = result.stdout.split("=== all_gather (")[1]
    assert (
        gathered.index("Rank 0: On rank 0") < gathered.index("Rank 1: On rank 1") < gathered.index("Rank 2: On rank 2")
    )


def test_collectives_demo_without_torchrun():
    result = run([prefork.python(), "-m", "experiments.collectives", "--nproc", "2", "--demo", "all_to_all"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all_to_all           ok" in result.stdout


BAD_ENVIRONMENTS = [
    (
        {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
        "RANK=3 must be < WORLD_SIZE=2",
    ),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    (
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",
        },
        "LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2",
    ),
    (
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
        "MASTER_PORT=70000 is out of range",
    ),
    (
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29999"},
        "MASTER_ADDR='no-such-host.invalid' does not resolve",
    ),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT"),
    ({"DIST_TIMEOUT_S": "0"}, "DIST_TIMEOUT_S=0"),
    ({"BACKEND": "mpi"}, "BACKEND='mpi' is not one of"),
    ({"BACKEND": "nccl"}, "BACKEND=nccl needs a CUDA GPU"),
    ({"SEED": "abc"}, "SEED='abc' is not an integer"),
]


@pytest.mark.parametrize("env,message", BAD_ENVIRONMENTS, ids=[m.split()[0] for _, m in BAD_ENVIRONMENTS])
def test_bad_environment_exits_2_with_one_line(tmp_path: Path, env: dict[str, str], message: str):
    # A hang would show as the subprocess timeout: torch's own behaviour here is a 30-minute wait.
    python = sys.executable if (env, message) == BAD_ENVIRONMENTS[0] else prefork.python()
    result = run([python, "-m", "experiments.toy", "--run-dir", str(tmp_path / "run")], timeout=60, **env)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()  # nothing written before the configuration is known to be good


def test_a_worker_closed_after_the_one_line_leaves_that_line_last():
    """Rank 1 exits 2 while rank 0, which printed the line, is still alive: torchrun closes rank 0 and logs
    it. The job exits 2 and its last line is still the worker's (torchrun's closing line is dropped)."""
    from tests.e2e.said_then_closed import LINE

    result = run(
        [
            prefork.python(),
            "-m",
            "ddp_core.torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "tests.e2e.said_then_closed",
        ]
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == LINE, result.stderr[-3000:]
    assert "closing signal" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_unknown_flag_exits_2():
    result = run([sys.executable, "-m", "experiments.toy", "--stepz", "3"], timeout=60)
    assert result.returncode == 2 and "unrecognized arguments: --stepz" in result.stderr


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_agents_as_two_nodes(tmp_path: Path, rendezvous: str):
    port = free_port()
    run_dir = tmp_path / "run"
    agents = []
    for node_rank in (0, 1):
        if rendezvous == "static":
            torchrun_args = (
                "--nnodes=2",
                f"--node-rank={node_rank}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
            )
        else:
            torchrun_args = (
                "--nnodes=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-nodes",
            )
        command = torchrun_command(
            1,
            "experiments.toy",
            "--run-dir",
            str(run_dir),
            "--steps",
            "5",
            "--dataset-size",
            "256",
            torchrun_args=torchrun_args,
        )
        agents.append(
            subprocess.Popen(
                command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [agent.communicate(timeout=180)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (
        manifest["world"]["world_size"] == 2
        and manifest["world"]["processes_per_node"] == 1
        and manifest["world"]["nodes"] == 2
    )


MISSING_PEER = {
    "static node 0": (
        ("--node-rank=0", "--master-addr=127.0.0.1", "--master-port={port}", "--rdzv-conf=timeout=3"),
        "node 1 (--node-rank=1) never joined the rendezvous at 127.0.0.1:{port} within 3 seconds (joined: node 0 (",
    ),
    "static node 1": (
        ("--node-rank=1", "--master-addr=127.0.0.1", "--master-port={port}", "--rdzv-conf=timeout=3"),
        "node 0 unreachable at 127.0.0.1:{port} within 3 seconds",
    ),
    "c10d": (
        ("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=alone", "--rdzv-conf=join_timeout=3"),
        "1 of 2 nodes never joined the rendezvous at 127.0.0.1:{port} within 3 seconds (joined: ",
    ),
}


@pytest.mark.parametrize("case", MISSING_PEER)
def test_a_node_whose_peer_never_starts_fails_in_words(tmp_path: Path, case: str):
    """torchrun's agents meet before any worker runs; ddp_core.torchrun names the endpoint, count and fix."""
    port = free_port()
    flags, message = MISSING_PEER[case]
    command = [
        prefork.python(),
        "-m",
        "ddp_core.torchrun",
        "--nnodes=2",
        *(f.format(port=port) for f in flags),
        "--nproc-per-node=1",
        "-m",
        "experiments.toy",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    result = run(command, timeout=60)  # the deadline: 3 s of rendezvous plus start-up, far from torch's 10-15 min
    assert result.returncode == 1, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: " + message.format(port=port)), result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rendezvous", ["standalone", "static"])
def test_restarted_workers_form_a_new_group(rendezvous: str):
    """Under --max-restarts the restarted workers re-initialise in the same store (docs/design.md, "Restarts
    and the shared rendezvous store"). A racy failure shows up in some attempts only: the killed-worker tests
    (test_faults, test_cifar10, test_resume_world_sizes, the docker pair) restart a group five more times per
    suite run."""
    torchrun_args = (
        ("--standalone",)
        if rendezvous == "standalone"
        else ("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}")
    )
    command = [
        prefork.python(),
        "-m",
        "torch.distributed.run",
        *torchrun_args,
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "tests.e2e.restart_probe",
    ]
    result = run(command, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "attempt 1 all_reduce 3 ok" in result.stdout


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_init_methods(tmp_path: Path, scheme: str):
    init_method = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    command = [
        prefork.python(),
        "-m",
        "experiments.collectives",
        "--nproc",
        "2",
        "--demo",
        "all_reduce",
        "--init-method",
        init_method,
    ]
    result = run(command, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all_reduce           ok" in result.stdout


def test_world_of_one_without_torchrun(tmp_path: Path):
    run_dir = tmp_path / "one"
    result = run(
        [sys.executable, "-m", "experiments.toy", "--run-dir", str(run_dir), "--steps", "3", "--dataset-size", "64"],
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "manifest.json").read_text())["world"]["world_size"] == 1
