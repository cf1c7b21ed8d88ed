"""``--heal`` across two hosts made of network namespaces (bench/netns.py), 2 processes each: a worker of the second
host SIGKILLed mid-run is replaced alone and receives the state from a peer through torchft (its manager's address,
its checkpoint server and its gloo group reached across hosts), the survivors keep their processes, and the run ends
bitwise-equal to the same job never hit. A whole host lost (its launcher SIGKILLed: its workers die with it) is no
heal: the other host's workers wait for the quorum until ``--dist-timeout-s``, and the job ends with one report."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from bench import timeline as worker_timeline
from bench.netns import Hosts
from ddp_core.process import timeline
from tests.e2e.heal_timeline import check_replaced_alone, training_pid
from tests.e2e.launch import final_weights
from tests.e2e.test_launch_paths import alive
from tests.hosts.test_hosts import PORTS, Job, Node, finish, outputs, start

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None, reason="--heal needs torchft: pip install -r requirements-heal.txt"
    ),
]

NPROC = 2
VICTIM = 3  # the second host's second worker
# The kill lands in a step, early (the test reacts within 0.1 s of rank 3's first step, about 15 steps a second on 2
# idle cores): its pauses, the only collectives on torch's group, are at steps 100 and 200 (--log-reads late: on CPU
# the ranks are otherwise asked for stop signals after every step). A kill in a pause heals only where every
# survivor failed that collective, after --dist-timeout-s (measured); where one had finished it and gone on to the
# next step's quorum, that quorum times out with the others' collective: exit 1 (measured, on one host).
STEPS = ("--steps", "200", "--dataset-size", "512", "--batch-size", "16", "--checkpoint-every", "100")
STEPS += ("--log-every", "100", "--log-reads", "late")
HEAL = ("--heal", "--max-restarts=1")
TIMEOUT_S = 30
LOST_TIMEOUT_S = 10  # how long the first host waits for the lost one


def heal_job(run_dir: Path, timeout_s: float = TIMEOUT_S) -> Job:
    args = (*STEPS, "--run-dir", str(run_dir), "--dist-timeout-s", str(timeout_s))
    return Job("experiments.toy", "static", NPROC, args=args, launcher_args=HEAL)


def start_watched(hosts: Hosts, job: Job, folder: Path) -> tuple[dict[int, Node], Path]:
    """The job, each worker noting its phases (``first_step`` with its pid and rank) in a timeline under ``folder``."""
    path = folder / "timeline"
    return start(hosts, job, next(PORTS), **worker_timeline.env(str(path))), path


def wait_for(condition, nodes: dict[int, Node], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(node.process.poll() is not None for node in nodes.values()):
            pytest.fail(f"{what}: not seen before a node ended or {timeout:g} s passed\n{outputs(nodes)}")
        time.sleep(0.05)  # polling a condition, not waiting for a guessed time


@pytest.fixture(scope="module")
def fault_free(two_hosts: Hosts, tmp_path_factory) -> Path:
    """The same --heal job never hit: the weights the healed run must end with, bitwise."""
    folder = tmp_path_factory.mktemp("heal-fault-free")
    nodes, _ = start_watched(two_hosts, heal_job(folder / "run"), folder)
    codes = finish(nodes)
    assert set(codes.values()) == {0}, outputs(nodes)
    return folder / "run"


def test_a_worker_killed_on_the_second_host_is_replaced_alone_and_the_run_ends_bitwise(
    two_hosts: Hosts, fault_free: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    nodes, path = start_watched(two_hosts, heal_job(run_dir), tmp_path)
    try:
        wait_for(lambda: training_pid(path, VICTIM) is not None, nodes, "rank 3's first step")
        before = {rank: training_pid(path, rank) for rank in range(2 * NPROC)}
        os.kill(before[VICTIM], signal.SIGKILL)  # the worker, not its client: that one replaces it
        codes = finish(nodes)
    finally:
        for node in nodes.values():
            node.end()
    assert set(codes.values()) == {0}, outputs(nodes)
    check_replaced_alone(path, VICTIM, before)
    expected, actual = final_weights(fault_free), final_weights(run_dir)
    assert [key for key in expected if not torch.equal(expected[key], actual[key])] == []


def test_a_whole_host_lost_is_no_heal_but_one_report_within_the_timeout(two_hosts: Hosts, tmp_path: Path):
    """The second host's launcher SIGKILLed (its clients and workers die with it, as in a power cut): nobody replaces
    its workers, so the first host's wait at the next step's quorum for the whole world until --dist-timeout-s
    (torchft's TimeoutError), then the job ends as a failed worker's does without --heal: one report, exit 1."""
    run_dir = tmp_path / "run"
    nodes, path = start_watched(two_hosts, heal_job(run_dir, LOST_TIMEOUT_S), tmp_path)
    try:
        wait_for(lambda: training_pid(path, VICTIM) is not None, nodes, "rank 3's first step")
        lost, second = nodes[1].process.pid, [training_pid(path, rank) for rank in range(NPROC, 2 * NPROC)]
        assert b"ddp_core.torchrun" in Path(f"/proc/{lost}/cmdline").read_bytes()  # the launcher, not a wrapper
        os.kill(lost, signal.SIGKILL)
        codes = finish(nodes)
    finally:
        for node in nodes.values():
            node.end()
    assert codes == {0: 1, 1: -signal.SIGKILL}, outputs(nodes)
    assert not any(alive(pid) for pid in second)  # the second host's workers died with its launcher
    reports = [line for line in nodes[0].lines if line.startswith("error: ")]
    first_host = tuple(f"error: rank {rank} (host host0) raised TimeoutError" for rank in range(NPROC))
    assert len(reports) == 1 and reports[0].startswith(first_host), outputs(nodes)
    # the first host's first rank to time out may be replaced (its node's budget): the replacement waits in vain too
    assert [e["code"] for e in timeline.read(path) if e["event"] == "replaced"] in ([], [1]), outputs(nodes)
