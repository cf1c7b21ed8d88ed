"""Elastic node ranges across 2 hosts made of network namespaces (bench/netns.py): c10d rendezvous with
``--nnodes=1:2`` through ddp_core.torchrun, a world that shrinks when a node dies for good and grows when a node
starts later, each run finishing with metrics.json; and, without a range, a refused resume that ends the job at
once instead of spending --max-restarts.

Timings: the rendezvous's keep-alive and last call are shortened (torch's defaults, 15 s to forget a dead node and
30 s of last call, are what a cluster wants, not a test).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.netns import Host, Hosts
from tests.e2e.launch import REPO, clean_env
from tests.hosts.test_hosts import PORTS, Node, finish, first_to_end, outputs

pytestmark = pytest.mark.hosts

TOY = ("--steps", "40", "--dataset-size", "512", "--batch-size", "16", "--checkpoint-every", "5", "--log-every", "10")
RANGE = "--nnodes=1:2"
# last call: how long a round that reached 1 node waits for a second; keep-alive: a dead node is forgotten
# after 5 s (a live node writes its heartbeat about every 2 s)
RDZV_CONF = "--rdzv-conf=join_timeout=60,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"
REFUSAL = "the checkpoint was written by"


class ElasticNode(Node):
    """A node whose output can be waited on, line by line, as it comes."""

    def __init__(self, host: Host, argv: list[str], env: dict[str, str]):
        self.arrived = threading.Condition()
        super().__init__(host, argv, env)

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.arrived:
                self.lines.append(line)
                self.arrived.notify_all()
        with self.arrived:
            self.arrived.notify_all()

    def wait_for(self, wanted: Callable[[str], bool], timeout: float) -> None:
        with self.arrived:
            if not self.arrived.wait_for(
                lambda: any(map(wanted, self.lines)) or self.process.poll() is not None, timeout
            ) or not any(map(wanted, self.lines)):
                pytest.fail(f"{self.host.hostname}: the line never came:\n{self.output[-4000:]}")


def launch(hosts: Hosts, node: int, port: int, nnodes: str, module: list[str], *args: str, **env: str) -> ElasticNode:
    argv = [
        sys.executable,
        "-m",
        "ddp_core.torchrun",
        nnodes,
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts[0].address()}:{port}",
        f"--rdzv-id=job{port}",
        RDZV_CONF,
        "--max-restarts=3",
        "--nproc-per-node=1",
        "-m",
        *module,
        *TOY,
        *args,
    ]
    return ElasticNode(hosts[node], argv, clean_env(DIST_TIMEOUT_S="60", DIST_INIT_TIMEOUT_S="60", **env))


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def resumed_at_another_size(node: Node) -> list[str]:
    return [line for line in node.lines if "not bitwise" in line]


def test_a_node_killed_for_good_the_run_continues_on_the_other(two_hosts: Hosts, tmp_path: Path):
    """2 -> 1: host1's agent and worker SIGKILLed at step 13 and never started again. host0's agent restarts
    its worker (one of --max-restarts=3), the rendezvous forgets the dead node and closes with host0 alone, and
    the run continues at world size 1 from the checkpoint of step 10: one warning line, the change in
    manifest.json, metrics.json at the end."""
    run_dir, port = tmp_path / "run", next(PORTS)
    kill = {"FAULT": "kill_node", "FAULT_RANK": "1", "FAULT_STEP": "13", "FAULT_ONCE": str(tmp_path / "killed")}
    module = ["tests.e2e.faulty", "experiments.toy"]
    nodes = {i: launch(two_hosts, i, port, RANGE, module, "--run-dir", str(run_dir), **kill) for i in (0, 1)}
    try:
        dead = first_to_end(nodes, timeout=180)
        assert dead == 1 and nodes[1].process.returncode == -signal.SIGKILL, outputs(nodes)
        codes = finish({0: nodes[0]}, timeout=180)
    finally:
        for node in nodes.values():
            node.end()
    assert codes == {0: 0}, outputs(nodes)
    assert (run_dir / "metrics.json").exists()
    written = manifest(run_dir)
    assert written["config_changes"] == ["world size: 2 -> 1"], written["config_changes"]
    assert written["world"]["world_size"] == 1 and written["world"]["nodes_range"] == "1:2"
    assert [run["world"]["world_size"] for run in written.get("history", [])][-1:] == [2]
    warnings = resumed_at_another_size(nodes[0])
    assert len(warnings) == 1, nodes[0].output[-4000:]
    assert "written by 2 processes at step 10, with 1 (--nnodes=1:2: the node range changed the world" in warnings[0]
    assert "--allow-config-change" not in nodes[0].output and REFUSAL not in nodes[0].output
    assert json.loads((run_dir / "metrics.json").read_text())["world_size"] == 1


def test_a_node_started_later_is_taken_in_at_the_next_restart(two_hosts: Hosts, tmp_path: Path):
    """1 -> 2: host0 alone starts the run at world size 1 (the round closes after its last call) and holds its
    step 12 until its agent stops it (tests/hosts/wait_for_more_nodes.py); host1 starts then. Its agent
    waiting to join makes host0's agent restart the workers (a membership change: no restart spent): they stop
    after the step with a checkpoint, and the new round, of both nodes, continues it at world size 2."""
    run_dir, port = tmp_path / "run", next(PORTS)
    module = ["tests.hosts.wait_for_more_nodes", "experiments.toy"]
    args = ("--run-dir", str(run_dir))
    first = launch(two_hosts, 0, port, RANGE, module, *args, WAIT_STEP="12")
    nodes = {0: first}
    try:
        first.wait_for(lambda line: "step 10/" in line, timeout=120)  # training alone, past a checkpoint
        nodes[1] = launch(two_hosts, 1, port, RANGE, module, *args, WAIT_STEP="12")
        codes = finish(nodes, timeout=180)
    finally:
        for node in nodes.values():
            node.end()
    assert codes == {0: 0, 1: 0}, outputs(nodes)
    assert (run_dir / "metrics.json").exists()
    written = manifest(run_dir)
    assert written["config_changes"] == ["world size: 1 -> 2"], written["config_changes"]
    assert written["world"]["world_size"] == 2 and written["hosts"] == ["host0", "host1"]
    warnings = [line for node in nodes.values() for line in resumed_at_another_size(node)]
    assert len(warnings) == 1, outputs(nodes)
    assert "written by 1 processes at step 12, with 2 (--nnodes=1:2" in warnings[0]
    assert json.loads((run_dir / "metrics.json").read_text())["world_size"] == 2


def test_without_a_range_another_world_is_refused_once_and_no_restart_is_spent(two_hosts: Hosts, tmp_path: Path):
    """--nnodes=2 (no range) resuming a checkpoint of 1 process, with --max-restarts=3: every worker refuses
    (exit 2), and both agents stop at once instead of restarting three times; the refusal is printed once."""
    run_dir, port = tmp_path / "run", next(PORTS)
    alone = subprocess.run(
        [sys.executable, "-m", "experiments.toy", *TOY, "--run-dir", str(run_dir), "--stop-at-step", "5"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    module = ["experiments.toy"]
    nodes = {i: launch(two_hosts, i, port, "--nnodes=2", module, "--run-dir", str(run_dir), "--resume") for i in (0, 1)}
    codes = finish(nodes, timeout=120)
    assert codes == {0: 2, 1: 2}, outputs(nodes)
    refusals = [line for node in nodes.values() for line in node.lines if REFUSAL in line]
    assert len(refusals) == 1, outputs(nodes)
    assert "written by 1 processes and this run has 2" in refusals[0] and "--allow-config-change" in refusals[0]
    assert not any("will restart worker group" in node.output for node in nodes.values()), outputs(nodes)
    assert manifest(run_dir)["world"]["world_size"] == 1  # the refused attempt recorded nothing
