"""A preflight verdict: one row of the table, a status per node (the worst of its ranks'), one line of detail
and, for a FAIL or WARN, one line saying how to fix it; with the helpers every check uses over the ranks' facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
SEVERITY = {SKIP: 0, PASS: 1, WARN: 2, FAIL: 3}
NO_CUDA = "skipped: no CUDA"
GIB, MIB = 1 << 30, 1 << 20
# Of the variables every rank must agree on (tools.preflight.probes.AGREED_VARIABLES), those naming per-host
# things (an interface, an adapter, a file): a difference there is only a WARN.
PER_HOST_VARIABLES = frozenset(
    {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG_FILE", "NCCL_TOPO_FILE", "NCCL_NET_PLUGIN"}
)


def worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=SEVERITY.__getitem__, default=SKIP)


@dataclass
class Verdict:
    """One row: ``nodes`` maps node index -> status."""

    name: str
    nodes: dict[int, str]
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return worst(self.nodes.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "nodes": {f"node{n}": s for n, s in sorted(self.nodes.items())},
            "detail": self.detail,
            "fix": self.fix,
            "data": self.data,
        }


# ---------------------------------------------------------------------------------------------------
# The layout of the job, from the facts


def nodes_of(facts: Sequence[Mapping[str, Any]]) -> dict[int, list[int]]:
    """node index -> its global ranks, in order."""
    nodes: dict[int, list[int]] = {}
    for fact in facts:
        nodes.setdefault(fact["node"], []).append(fact["rank"])
    return {node: sorted(ranks) for node, ranks in sorted(nodes.items())}


def leaders(facts: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """node index -> the rank that speaks for it (its lowest: its local rank 0 under torchrun)."""
    return {node: ranks[0] for node, ranks in nodes_of(facts).items()}


def all_nodes(facts: Sequence[Mapping[str, Any]], status: str) -> dict[int, str]:
    return {node: status for node in nodes_of(facts)}


def ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def by_node(facts: Sequence[Mapping[str, Any]], ranks: Iterable[int]) -> dict[int, list[int]]:
    node_of = {f["rank"]: f["node"] for f in facts}
    out: dict[int, list[int]] = {}
    for rank in sorted(set(ranks)):
        out.setdefault(node_of[rank], []).append(rank)
    return out


def ranks_where(facts: Sequence[Mapping[str, Any]], ranks: Iterable[int]) -> str:
    """'node1 (ranks 2-3)', several nodes joined with ', '."""
    return ", ".join(f"node{node} ({ranks_text(r)})" for node, r in by_node(facts, ranks).items())


def memory_size(count: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"


def ib_wanted(facts: Sequence[Mapping[str, Any]]) -> bool:
    return any(f["ib_requested"] for f in facts)
