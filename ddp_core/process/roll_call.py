"""Which nodes reached the rendezvous, and one sentence for a rendezvous that failed (``python -m ddp_core.torchrun``):
torchrun's agents meet before any worker runs, and their errors name no node (docs/decisions.md, "The launcher").
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from argparse import Namespace
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.run as torch_run
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

# How the agents' meeting fails: a timeout, a key that never came, a store that was never reached or went
# away, a rendezvous another node closed when it gave up.
RENDEZVOUS_FAILURES = (
    RendezvousTimeoutError,
    RendezvousClosedError,
    RendezvousConnectionError,
    DistStoreError,
    DistNetworkError,
)


def endpoint(args: Namespace) -> str:
    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return args.rdzv_endpoint


def _timeout(args: Namespace) -> float | None:
    match = re.search(r"(?:^|,)\s*(?:join_)?timeout\s*=\s*([0-9.]+)", args.rdzv_conf or "")
    return float(match.group(1)) if match else None


ROLL_CALL_DEFAULT_S = 600.0  # torchrun's own default for both rendezvous kinds
WATCH_STEP_S = 0.5  # how often the roll call looks for nodes that signed, and how long stopping it takes


class RollCall:
    """The nodes that reached the rendezvous store, as seen from this one (a thread and its own store client, which
    writes only under ``ddp_lab/roll_call/<id>/``). Under static the missing node is named; under c10d, counted."""

    def __init__(self, args: Namespace):
        self.static = args.rdzv_backend == "static"
        self.expected = torch_run.parse_min_max_nnodes(args.nnodes)[1]
        self.node_rank = args.node_rank if self.static else None
        self.prefix = f"ddp_lab/roll_call/{args.rdzv_id}"
        self.timeout_s = (_timeout(args) or ROLL_CALL_DEFAULT_S) + 60  # outlives the rendezvous it watches
        self.seen: list[dict[str, object]] = []
        self.stopping = threading.Event()
        host, _, port = endpoint(args).rpartition(":")
        self.address = (host.strip("[]"), int(port) if port.isdigit() else 29400)
        self.thread = threading.Thread(target=self._watch, name="ddp_lab roll call", daemon=True)

    def start(self) -> "RollCall":
        if self.expected > 1:
            self.thread.start()
        return self

    def stop(self) -> None:
        """Before the process ends: a thread still inside a store call when Python finalizes aborts the process."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * WATCH_STEP_S)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._reachable():  # quietly: a store client would log every retry, as the agent already does
            if self.stopping.wait(WATCH_STEP_S) or time.monotonic() > deadline:
                return
        try:
            store = dist.TCPStore(
                *self.address, is_master=False, timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False
            )
            slot = store.add(f"{self.prefix}/count", 1)
            store.set(
                f"{self.prefix}/{slot}",
                json.dumps({"node_rank": self.node_rank, "host": socket.gethostname(), "pid": os.getpid()}),
            )
            index = 1
            while index <= self.expected and time.monotonic() < deadline:
                key = f"{self.prefix}/{index}"  # the next node to sign, in the order they reached the store
                if store.check([key]):  # not store.wait: a wait that times out logs a warning each time
                    self.seen.append(json.loads(store.get(key)))
                    index += 1
                elif self.stopping.wait(WATCH_STEP_S):
                    return
        except Exception:  # the store went away, or was never reached: what was seen is the answer
            return

    def _reachable(self) -> bool:
        try:
            socket.create_connection(self.address, timeout=WATCH_STEP_S).close()
        except OSError:
            return False
        return True

    def missing(self) -> str | None:
        """'node 2 (--node-rank=2)' or '1 of 3 nodes', or None when this node never reached the store or all came."""
        seen = list(self.seen)
        if not seen:
            return None
        if self.static:
            joined = {entry["node_rank"] for entry in seen}
            absent = [rank for rank in range(self.expected) if rank not in joined]
            if not absent:
                return None
            ranks = ", ".join(map(str, absent))
            return f"node {ranks} (--node-rank={ranks})" if len(absent) == 1 else f"nodes {ranks}"
        count = self.expected - len(seen)
        return f"{count} of {self.expected} nodes" if count > 0 else None

    def joined(self) -> str:
        if self.static:
            return ", ".join(
                f"node {e['node_rank']} ({e['host']})" for e in sorted(self.seen, key=lambda e: e["node_rank"])
            )
        return ", ".join(str(e["host"]) for e in self.seen)


def explain(error: BaseException, args: Namespace, roll_call: RollCall | None = None) -> str | None:
    """The one-line message for a rendezvous that failed, or None when ``error`` is something else."""
    where, seconds, nodes = endpoint(args), _timeout(args), args.nnodes
    within = f"{seconds:g} seconds" if seconds is not None else "torchrun's rendezvous timeout"
    start_them = (
        f"start every node (NNODES={nodes}) with the same MASTER_ADDR/MASTER_PORT, and check that they reach "
        f"{where} (firewall, address)"
    )
    missing = roll_call.missing() if roll_call is not None else None
    if missing is not None and roll_call is not None and isinstance(error, RENDEZVOUS_FAILURES):
        one = missing.startswith("node ") or missing.startswith("1 of")
        start = "start the missing node(s) with the same command"
        if roll_call.static:
            start = "start it" if one else "start them"
        return (
            f"{missing} never joined the rendezvous at {where} within {within} (joined: {roll_call.joined()}): "
            f"{start}, and check that {'it reaches' if one else 'they reach'} {where} (firewall, address)"
        )
    if isinstance(error, RendezvousClosedError):
        return (
            f"another node closed rendezvous {args.rdzv_id!r} at {where} (it gave up waiting): "
            f"its own error says why (NNODES={nodes})"
        )
    if isinstance(error, RendezvousConnectionError):
        return (
            f"lost the rendezvous store at {where}: the node serving it stopped or became unreachable; "
            f"its own error says why (NNODES={nodes})"
        )
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"the nodes did not all join rendezvous {args.rdzv_id!r} at {where} within {within} (NNODES={nodes}): "
            f"{start_them}"
        )
    text = str(error)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if isinstance(error, DistStoreError) and joined:
        return f"only {joined.group(1)} of {joined.group(2)} nodes joined at {where} within {within}: {start_them}"
    if isinstance(error, DistNetworkError) and "timed out" in text.lower():
        return (
            f"node 0 unreachable at {where} within {within}: is node 0 (NODE_RANK=0) running, and is {where} "
            "reachable from this host (firewall, MASTER_ADDR)?"
        )
    return None
