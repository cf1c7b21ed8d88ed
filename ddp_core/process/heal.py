"""``--heal``, the launcher's side (docs/faults.md): a dead worker alone is replaced (by its client, process.warm);
the survivors and it heal through torchft's lighthouse, served by group rank 0's agent. torchft: only under --heal.
The workers' variables: ``DDP_LAB_HEAL=1``; ``TORCHFT_LIGHTHOUSE``, the lighthouse's ``http://host:port``; in a
replacement only, ``DDP_LAB_HEAL_REPLACEMENT=n`` (n >= 1: the replacements this local rank has had).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

from ddp_core.distributed.env import HEAL_REPLACEMENT_VARIABLE as REPLACEMENT_VARIABLE
from ddp_core.distributed.env import HEAL_VARIABLE as VARIABLE

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"  # torchft's Manager reads it by this name
BUDGET_VARIABLE = "DDP_LAB_HEAL_BUDGET"  # the clients' only: this node's replacements (--max-restarts)
LIGHTHOUSE_KEY = "ddp_lab/lighthouse"  # in the rendezvous store, for the other nodes' agents
VARIABLES = (VARIABLE, LIGHTHOUSE_VARIABLE, BUDGET_VARIABLE, REPLACEMENT_VARIABLE)  # set for one launch


def refusal(launch: Any, nodes: tuple[int, int]) -> str | None:
    """Why --heal cannot run with torchrun's options ``launch`` (its node range ``nodes``), in one line, or None."""
    max_restarts, not_python = launch.max_restarts, launch.no_python or getattr(launch, "numa_binding", None)
    reasons = [
        (max_restarts <= 0, "--heal replaces a dead worker from --max-restarts: give --max-restarts=N, N > 0"),
        (nodes[0] < nodes[1], f"--heal keeps the world's size: give --nnodes one number, not {nodes[0]}:{nodes[1]}"),
        (not_python, "--heal runs each worker under python, its client's child: drop --no-python, --numa-binding"),
        (nodes[1] == 1 and str(launch.nproc_per_node) == "1", "--heal heals from a peer: run 2 or more processes"),
        (importlib.util.find_spec("torchft") is None, "--heal needs torchft: pip install -r requirements-heal.txt"),
    ]
    return next((why for refused, why in reasons if refused), None)


def budget() -> int:
    """This node's replacements under --heal (0: no --heal)."""
    return int(os.environ.get(BUDGET_VARIABLE) or 0) if os.environ.get(VARIABLE) == "1" else 0


def meet_at_the_lighthouse(group: Any, lighthouse: Any) -> Any:
    """After a rendezvous: group rank 0's agent serves the lighthouse (``lighthouse``, else a new one) where the
    other nodes reach it: at its --local-addr, else the address it reaches the store from (not its host name, which
    may resolve to 127.0.1.1), published in the store; each agent's workers get it. Returns this agent's lighthouse."""
    if group.group_rank == 0:
        if lighthouse is None:
            from torchft.coordination import LighthouseServer

            world = group.group_world_size * group.spec.local_world_size  # no step commits with a worker missing
            lighthouse = LighthouseServer(
                bind="[::]:0", min_replicas=world, join_timeout_ms=100, heartbeat_timeout_ms=1000
            )
        from ddp_core.distributed.network import route_source

        ip = socket.getaddrinfo(group.master_addr, group.master_port, type=socket.SOCK_STREAM)[0][4][0]
        host = group.spec.local_addr or route_source(ip, group.master_port)
        port = lighthouse.address().rsplit(":", 1)[1]
        group.store.set(LIGHTHOUSE_KEY, f"http://{f'[{host}]' if ':' in host else host}:{port}".encode())
    os.environ[LIGHTHOUSE_VARIABLE] = group.store.get(LIGHTHOUSE_KEY).decode()
    return lighthouse
