"""The preflight's probe that the nodes reach each other, over the rendezvous store, before the group exists."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.network import NetworkChoice, is_loopback

PROBE_TIMEOUT_S = 5.0  # a TCP connect across a working private network takes milliseconds


@dataclass(frozen=True)
class NodeReport:
    node: int
    host: str
    choice: dict[str, Any] | None  # NetworkChoice.as_dict()
    problem: str | None  # why this node could not choose
    unreachable: dict[int, str]  # peer node -> what connecting to it did


def _connect(address: str, port: int, timeout_s: float) -> str | None:
    started = time.monotonic()
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer within {timeout_s:g} s (a firewall dropping packets, or no route back)"
    except OSError as error:
        return f"{error.strerror or error} after {time.monotonic() - started:.1f} s"


def probe_reachability(
    store: dist.Store,
    env: DistEnv,
    node: int,
    choice: NetworkChoice | None,
    problem: str | None,
    timeout_s: float,
    connect_timeout_s: float = PROBE_TIMEOUT_S,
) -> list[NodeReport]:
    """Every node's leader listens on its chosen address and connects to every other's, so a firewall that lets
    only the rendezvous port through shows in seconds, not as a timeout at init. Every rank calls it and gets
    the same reports."""
    nodes = env.num_nodes
    wait = timedelta(seconds=timeout_s)
    listener = None
    if env.local_rank == 0:
        entry: dict[str, Any] = {
            "node": node,
            "host": socket.gethostname(),
            "choice": choice.as_dict() if choice else None,
            "problem": problem,
        }
        if choice is not None and choice.address and not is_loopback(choice.address):
            family = socket.AF_INET6 if ":" in choice.address else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.bind((choice.address, 0))
            listener.listen(max(8, nodes))  # the kernel completes the handshakes: nothing needs to accept
            entry["port"] = listener.getsockname()[1]
        store.set(f"reach/node/{node}", json.dumps(entry))
    try:
        store.wait([f"reach/node/{n}" for n in range(nodes)], wait)
        entries = {n: json.loads(store.get(f"reach/node/{n}")) for n in range(nodes)}
        if env.local_rank == 0:
            peers = {n: e for n, e in entries.items() if n != node and "port" in e}
            failures: dict[int, str] = {}
            if listener is not None and peers:
                with ThreadPoolExecutor(max_workers=min(32, len(peers))) as pool:
                    answers = pool.map(
                        lambda e: _connect(e["choice"]["address"], e["port"], connect_timeout_s), peers.values()
                    )
                    failures = {n: answer for n, answer in zip(peers, answers) if answer is not None}
            store.set(f"reach/result/{node}", json.dumps({str(n): text for n, text in failures.items()}))
        # The listeners stay open until every leader is done.
        store.wait([f"reach/result/{n}" for n in range(nodes)], wait)
        results = {n: {int(k): v for k, v in json.loads(store.get(f"reach/result/{n}")).items()} for n in range(nodes)}
    finally:
        if listener is not None:
            listener.close()
    return [
        NodeReport(n, entries[n]["host"], entries[n]["choice"], entries[n]["problem"], results[n]) for n in range(nodes)
    ]
