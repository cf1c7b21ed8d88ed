"""A node that cannot choose its network interface, N times over: does every node stop at once, each with one line?

    python -m bench.cannot_choose --runs 100              # 2 hosts, static rendezvous
    python -m bench.cannot_choose --runs 50 --hosts 3
    python -m bench.cannot_choose --runs 50 --after-missing   # each run right after a node that never started

Hosts are network namespaces (bench/netns.py: root and iproute2 needed). Every host runs
``python -m ddp_core.torchrun`` with ``--master-addr=host0``, a name that resolves to a loopback address
on host0 itself, which has two interfaces: host0 cannot tell which one the others reach and refuses.
A run fails unless every node exits 2 within ``--timeout`` seconds with one "error: " line: host0's
own, and on the others one naming node 0. DIST_INIT_TIMEOUT_S is 120 s, as in tests/hosts, so a node
left waiting for a peer shows as a run past the timeout, not as a quick error. The summary gives the
failures out of N with their last lines, and the seconds a run took until every node ended (median, max).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import missing_node
from bench.netns import Hosts, cannot_create_reason, settle
from bench.processes import child_env
from ddp_core.config import option
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]


@dataclass
class CannotChooseArgs:
    runs: int = option(100, "runs", minimum=1, maximum=100_000)
    hosts: int = option(2, "hosts (host0 is the one that cannot choose)", minimum=2, maximum=9)
    timeout: float = option(60.0, "seconds a run may take before it counts as hung", minimum=5, maximum=600)
    after_missing: bool = option(
        False, "before each run, a c10d job whose last node never starts on the same hosts (tests/hosts' order)"
    )


def node_command(count: int, node: int, port: int, run_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ddp_core.torchrun",
        f"--nnodes={count}",
        f"--node-rank={node}",
        "--master-addr=host0",
        f"--master-port={port}",
        "--nproc-per-node=1",
        "-m",
        "experiments.toy",
        "--run-dir",
        run_dir,
    ]


def run_once(hosts: Hosts, port: int, folder: str, timeout: float) -> tuple[str | None, float]:
    """(None when every node stopped with its one line, else what went wrong; the run's seconds)."""
    env = child_env(OMP_NUM_THREADS="1", DIST_TIMEOUT_S="120", DIST_INIT_TIMEOUT_S="120")
    began = time.monotonic()
    started = [
        hosts[i].start(node_command(len(hosts), i, port, f"{folder}/{port}"), env, REPO) for i in range(len(hosts))
    ]
    ended = settle(started, timeout)
    seconds = time.monotonic() - began
    problems = []
    for node, (code, output) in enumerate(ended):
        errors = [line.strip() for line in output.splitlines() if line.startswith("error: ")]
        expected = "error: MASTER_ADDR=host0 resolves to" if node == 0 else "error: node 0 (host0) cannot start"
        if code != CONFIG_ERROR_EXIT_CODE or len(errors) != 1 or not errors[0].startswith(expected):
            last = (output.strip().splitlines() or [""])[-1]
            state = "still running" if code is None else f"exit {code}"
            problems.append(f"host{node} {state}: {last[:140]}")
    return "; ".join(problems) or None, seconds


def run_bench(args: CannotChooseArgs) -> int:
    reason = cannot_create_reason()
    if reason is not None:
        print(f"cannot_choose: cannot create network namespaces here ({reason})")
        return 2
    failures: list[str] = []
    seconds: list[float] = []
    ports = itertools.count(31000)
    with Hosts(args.hosts) as hosts, tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            if args.after_missing:
                missing_node.run_once("c10d", hosts, next(ports), folder)  # its own outcome is bench.missing_node's
            problem, took = run_once(hosts, next(ports), folder, args.timeout)
            seconds.append(took)
            if problem:
                failures.append(problem)
                print(f"  run {i + 1}: {problem}", flush=True)
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{args.runs}: {len(failures)} failed, slowest run {max(seconds):.1f} s", flush=True)
    print(f"a node that cannot choose its interface, {args.hosts} hosts:")
    print(f"  {len(failures)} of {args.runs} runs did not stop every node with its one line within {args.timeout:g} s")
    print(f"  seconds per run: median {statistics.median(seconds):.1f}, max {max(seconds):.1f}")
    for text, count in collections.Counter(failures).most_common(5):
        print(f"      {count} x {text}")
    return 1 if failures else 0


main = command_main(CannotChooseArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
