"""A node that never starts, N times over: does every node that did start end with the one line naming it?

    python -m bench.missing_node --runs 200                   # 3 hosts, static then c10d rendezvous, alternating
    python -m bench.missing_node --runs 100 --hosts 2 --rendezvous c10d

Hosts are network namespaces (bench/netns.py: root and iproute2 needed). Each run starts every
host but the last with ``python -m ddp_core.torchrun`` (a join timeout of 5 s, the toy as the job) and
counts a failure when a started node does not exit 1 within 60 s with its last line beginning
"error: node N (--node-rank=N) never joined" (static) or "error: 1 of N nodes never joined" (c10d). The
summary gives the failures of each rendezvous out of its runs and, for each, the last line seen.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.netns import Hosts, cannot_create_reason, settle
from ddp_core.config import option
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]
JOIN_TIMEOUT_S = 5


@dataclass
class MissingNodeArgs:
    runs: int = option(200, "runs of each rendezvous", minimum=1, maximum=100_000)
    hosts: int = option(3, "hosts, the last of which never starts", minimum=2, maximum=9)
    rendezvous: str = option("both", "which rendezvous to run", choices=("static", "c10d", "both"))


def node_command(kind: str, hosts: Hosts, node: int, port: int, run_dir: str) -> list[str]:
    master, count = hosts[0].address(), len(hosts)
    if kind == "static":
        meet = [
            f"--nnodes={count}",
            f"--node-rank={node}",
            f"--master-addr={master}",
            f"--master-port={port}",
            f"--rdzv-conf=timeout={JOIN_TIMEOUT_S}",
        ]
    else:
        meet = [
            f"--nnodes={count}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master}:{port}",
            f"--rdzv-id=missing{port}",
            f"--rdzv-conf=join_timeout={JOIN_TIMEOUT_S}",
        ]
    return [
        sys.executable,
        "-m",
        "ddp_core.torchrun",
        *meet,
        "--nproc-per-node=1",
        "-m",
        "experiments.toy",
        "--run-dir",
        run_dir,
    ]


def run_once(kind: str, hosts: Hosts, port: int, folder: str) -> str | None:
    """None when every started node said it in one line; else what went wrong."""
    expected = (
        f"error: node {len(hosts) - 1} (--node-rank="
        if kind == "static"
        else f"error: 1 of {len(hosts)} nodes never joined"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = [
        hosts[i].start(node_command(kind, hosts, i, port, f"{folder}/{port}"), env, REPO) for i in range(len(hosts) - 1)
    ]
    problems = []
    for code, output in settle(started, timeout=60):
        last = (output.strip().splitlines() or [""])[-1]
        if code != 1 or not last.startswith(expected):
            problems.append(f"exit {code}: {last[:140]}")
    return "; ".join(problems) or None


def run_bench(args: MissingNodeArgs) -> int:
    reason = cannot_create_reason()
    if reason is not None:
        print(f"missing_node: cannot create network namespaces here ({reason})")
        return 2
    kinds = ["static", "c10d"] if args.rendezvous == "both" else [args.rendezvous]
    failures: dict[str, list[str]] = {kind: [] for kind in kinds}
    ports = itertools.count(30000)
    with Hosts(args.hosts) as hosts, tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            for kind in kinds:  # alternating, so the machine's load hits both alike
                problem = run_once(kind, hosts, next(ports), folder)
                if problem:
                    failures[kind].append(problem)
            if (i + 1) % 10 == 0:
                print(
                    f"  {i + 1}/{args.runs}: " + ", ".join(f"{k} {len(v)} failed" for k, v in failures.items()),
                    flush=True,
                )
    print(f"a node that never starts, {args.hosts} hosts, {args.runs} runs each:")
    for kind, seen in failures.items():
        print(f"  {kind}: {len(seen)} of {args.runs} runs did not end with the one line")
        for text, count in collections.Counter(seen).most_common(5):
            print(f"      {count} x {text}")
    return 1 if any(failures.values()) else 0


main = command_main(MissingNodeArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
