"""Preflight in the image: two containers on one network run it as a 2-node job (EXPERIMENT=preflight), as
two hosts would before a real run. CPU, gloo."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ddp_core.exit_codes import PREFLIGHT_FAILED_EXIT_CODE
from tests.docker.conftest import require_tool
from tests.docker.engine import (
    REPO,
    build_image,
    copy_build_context,
    docker,
    engine_available,
    standin_base_image,
    temporary_network,
)

pytestmark = pytest.mark.docker
TAG = f"ddp-lab:preflight-test-{os.getpid()}"
FLAGS = ("--bandwidth-mib", "1", "--bandwidth-reps", "2", "--json", "/tmp/preflight.json")


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    require_tool("a running Docker engine (dockerd)", engine_available())
    require_tool("mmdebstrap (to build the stand-in base image)", shutil.which("mmdebstrap") is not None)
    context = copy_build_context(tmp_path_factory.mktemp("context"))
    build_image(context, TAG, standin_base_image())
    yield TAG
    docker("rmi", "-f", TAG, check=False)


@pytest.fixture
def network(image: str):  # after the image: the containers on it need one
    with temporary_network("ddplab-preflight") as name:
        yield name


def run_two_nodes(
    network: str, node_args: tuple[list[str], list[str]], json_dir: Path, timeout: float = 240
) -> list[tuple[int, str, dict | None]]:
    """Node 0 and node 1 as detached containers; each one's exit code, log, and node 0's --json document."""
    common = [
        "EXPERIMENT=preflight",
        "NNODES=2",
        f"MASTER_ADDR={network}-node0",
        "NPROC_PER_NODE=1",
        "DIST_INIT_TIMEOUT_S=60",
    ]
    names = [f"{network}-node{rank}" for rank in (0, 1)]
    try:
        for rank, name in enumerate(names):
            env = [part for item in (*common, f"NODE_RANK={rank}") for part in ("-e", item)]
            docker(
                "run",
                "-d",
                "--name",
                name,
                "--hostname",
                name,
                "--network",
                network,
                *node_args[rank],
                *env,
                TAG,
                *FLAGS,
            )
        outcomes = []
        for rank, name in enumerate(names):
            code = int(docker("wait", name, timeout=timeout).stdout.strip())
            logs = docker("logs", name, check=False)
            document = None
            target = json_dir / f"node{rank}.json"
            if rank == 0 and docker("cp", f"{name}:/tmp/preflight.json", str(target), check=False).returncode == 0:
                document = json.loads(target.read_text())  # a stopped container's files can still be copied
            outcomes.append((code, logs.stdout + logs.stderr, document))
        return outcomes
    finally:
        for name in names:
            docker("rm", "-f", name, check=False)


def test_two_containers_pass_preflight_as_a_two_node_job(network: str, tmp_path: Path):
    """Node 0 keeps Docker's 64 MB /dev/shm (a WARN, not a failure), node 1 gets 1 GiB."""
    outcomes = run_two_nodes(network, ([], ["--shm-size=1g"]), tmp_path)
    assert [code for code, _, _ in outcomes] == [0, 0], "\n\n".join(log[-3000:] for _, log, _ in outcomes)
    log, document = outcomes[0][1], outcomes[0][2]
    assert "preflight: 2 node(s), 2 rank(s), gloo on cpu" in log and "preflight passed" in log
    assert f"node0 = {network}-node0 (rank 0); node1 = {network}-node1 (rank 1)" in log
    assert document is not None and document["ok"] is True and document["world"]["nodes"] == 2
    status = {c["name"]: c["nodes"] for c in document["checks"]}
    for name in ("versions", "code", "environment", "run_dir", "all_reduce", "bandwidth", "clock_skew"):
        assert status[name] == {"node0": "PASS", "node1": "PASS"}, (name, log[-3000:])
    assert status["shm"] == {"node0": "WARN", "node1": "PASS"} and "WARN shm: " in log
    code_check = next(c for c in document["checks"] if c["name"] == "code")
    assert "no git" in code_check["detail"]  # the image has no .git: the code files themselves are compared


def test_a_container_with_an_edited_file_fails_preflight_naming_it(network: str, tmp_path: Path):
    edited = tmp_path / "toy.py"
    edited.write_text((REPO / "experiments" / "toy.py").read_text() + "# edited on this host only\n")
    edited.chmod(0o644)
    outcomes = run_two_nodes(
        network, (["--shm-size=1g"], ["--shm-size=1g", "-v", f"{edited}:/app/experiments/toy.py:ro"]), tmp_path
    )
    assert [code for code, _, _ in outcomes] == [PREFLIGHT_FAILED_EXIT_CODE] * 2, "\n\n".join(
        log[-3000:] for _, log, _ in outcomes
    )
    log, document = outcomes[0][1], outcomes[0][2]
    assert (
        "node1 (rank 1): experiments/toy.py (edited)" in log
        and "FAIL code: run the same ddp-lab code on every node" in log
    )
    assert document is not None and document["exit_code"] == PREFLIGHT_FAILED_EXIT_CODE
    assert [c["name"] for c in document["checks"] if c["status"] == "FAIL"] == ["code"]
