"""Preflight's rows about the links between ranks: the nodes' interfaces, their clocks, an all-reduce,
the bandwidth between nodes and NCCL's transport."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from tools.preflight.verdict import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Verdict,
    all_nodes,
    by_node,
    ib_wanted,
    memory_size,
    nodes_of,
    ranks_where,
    worst,
)

LOCAL_ROUTE_ANSWERS = ("No route to host", "Network is unreachable")  # the connecting host's own routing said no


def _choice_text(report: Mapping[str, Any]) -> str:
    choice = report["choice"]
    if choice is None:
        return f"node{report['node']} ?"
    how = "yours" if choice["yours"] else "chosen"
    where = f"{choice['interface']} {choice['address']}" if choice["address"] else choice["interface"]
    return f"node{report['node']} {where} ({how})"


def _suspects(failed: Sequence[tuple[int, int, str]]) -> list[int]:
    """The nodes in every failed link; of a single pair, the one whose own routing refused, if only one did."""
    common = set.intersection(*({a, b} for a, b, _ in failed))
    if len(common) == 2:
        refused = {a for a, _, text in failed if text.startswith(LOCAL_ROUTE_ANSWERS)}
        if len(refused) == 1:
            return sorted(refused)
    return sorted(common)


def check_network(reports: Sequence[Mapping[str, Any]], nodes: Sequence[int]) -> Verdict:
    """Each node's interface for the backend (ddp_core.distributed.network) and whether the other nodes reach it.

    ``reports``: ``reach.probe_reachability``'s NodeReport of every node, as dicts; empty on one node.
    """
    if not reports:
        return Verdict("network", {n: SKIP for n in nodes}, "skipped: one node (its ranks connect over loopback)")
    status = {r["node"]: PASS for r in reports}
    host = {r["node"]: r["host"] for r in reports}
    variable = next((r["choice"]["variable"] for r in reports if r["choice"]), "GLOO_SOCKET_IFNAME")
    problems = [r for r in reports if r["problem"]]
    failed = [(r["node"], peer, text) for r in reports for peer, text in sorted(r["unreachable"].items())]
    for r in reports:
        if r["choice"] is None and not r["problem"]:
            status[r["node"]] = SKIP  # a file:// rendezvous names no host to route to
        elif r["choice"] is not None and not r["choice"]["address"]:
            status[r["node"]] = SKIP  # an NCCL pattern of yours: NCCL chooses among the rest, not probed
    for r in problems:
        status[r["node"]] = FAIL
    for a, b, _ in failed:
        status[a] = status[b] = FAIL
    chosen = ", ".join(_choice_text(r) for r in reports if r["choice"])
    data = {"nodes": [dict(r) for r in reports]}
    if problems:
        first = problems[0]
        detail = "; ".join(f"node{r['node']} ({r['host']}): {r['problem']}" for r in problems)
        return Verdict("network", status, detail, f"node{first['node']} ({first['host']}): {first['problem']}", data)
    if failed:
        links = "; ".join(f"node{a} -> node{b}: {text}" for a, b, text in failed)
        suspects = _suspects(failed)
        named = " and ".join(f"node{n} ({host[n]})" for n in suspects) or "the nodes named"
        interface = next(
            (r["choice"]["interface"] for r in reports if r["node"] in suspects and r["choice"]), "its interface"
        )
        fix = (
            f"{named} cannot reach the other nodes on {interface}, or be reached there "
            "(a route or a firewall that lets only the rendezvous port through): "
            f"fix its routes or firewall (`ip route get ADDRESS` on it), or set {variable} on every "
            "node to an interface on a network they all reach"
        )
        return Verdict("network", status, f"{chosen} | {links}", fix, data)
    return Verdict("network", status, f"{chosen}: every node reaches every other", data=data)


def check_clocks(
    facts: Sequence[Mapping[str, Any]], offsets: Mapping[int, tuple[float, float]], warn_s: float, fail_s: float
) -> Verdict:
    """``offsets``: node -> (offset in seconds against rank 0's clock, uncertainty) for every other node."""
    if len(nodes_of(facts)) == 1:
        return Verdict("clock_skew", all_nodes(facts, SKIP), "skipped: one node, one clock")
    status = all_nodes(facts, PASS)
    parts = []
    for node, (offset, uncertainty) in sorted(offsets.items()):
        size = abs(offset)
        status[node] = FAIL if size > fail_s else WARN if size > warn_s else PASS
        parts.append(f"node{node} {offset:+.3f} s (±{uncertainty:.3f})")
    bad = [n for n, s in status.items() if s != PASS]
    fix = (
        (
            f"synchronise the clocks (chrony or systemd-timesyncd against one NTP server on every host); "
            f"thresholds --clock-warn-s {warn_s:g}, --clock-fail-s {fail_s:g}"
        )
        if bad
        else ""
    )
    return Verdict("clock_skew", status, "against rank 0's clock: " + ", ".join(parts), fix)


def check_all_reduce(
    facts: Sequence[Mapping[str, Any]], correct: Mapping[int, bool], seconds: float, nbytes: int
) -> Verdict:
    status = all_nodes(facts, PASS)
    wrong = [rank for rank, ok in correct.items() if not ok]
    for rank in wrong:
        status[by_node(facts, [rank]).popitem()[0]] = FAIL
    if wrong:
        return Verdict(
            "all_reduce",
            status,
            f"wrong sum on {ranks_where(facts, wrong)}",
            "a wrong result means broken hardware or a broken library: rerun with NCCL_DEBUG=WARN "
            "and test the named nodes' GPUs/NICs alone",
        )
    return Verdict(
        "all_reduce",
        status,
        f"{len(facts)} ranks, {memory_size(nbytes)} int64: exact sum, {seconds * 1e3:.1f} ms",
        data={"seconds": seconds, "bytes": nbytes},
    )


def check_bandwidth(
    facts: Sequence[Mapping[str, Any]],
    links: Sequence[tuple[int, int, float]],
    slow_fraction: float,
    min_gbps: float,
    what: str,
) -> Verdict:
    """``links``: (node a, node b, GB/s) measured between their leaders; a link far below the median is named."""
    if not links:
        return Verdict("bandwidth", all_nodes(facts, SKIP), "skipped: one process")
    status = all_nodes(facts, PASS)
    median = statistics.median(rate for _, _, rate in links)
    slow, parts = [], []
    for a, b, rate in links:
        level = FAIL if rate < min_gbps else WARN if rate < slow_fraction * median else PASS
        for node in {a, b}:
            status[node] = worst((status[node], level))
        label = f"node{a}<->node{b}" if a != b else f"within node{a} (rank 0<->1)"
        parts.append(f"{label} {rate:.2f} GB/s")
        if level != PASS:
            slow.append(label)
    fix = (
        (
            f"slow link(s) {', '.join(slow)}: check the NICs, cables and switch ports between those hosts, "
            "and that NCCL uses the fast interface (NCCL_SOCKET_IFNAME, NCCL_IB_HCA)"
        )
        if slow
        else ""
    )
    return Verdict(
        "bandwidth",
        status,
        f"{what}: " + ", ".join(parts) + (f"; median {median:.2f} GB/s" if len(links) > 1 else ""),
        fix,
        data={"links": [{"a": a, "b": b, "gbps": r} for a, b, r in links]},
    )


def check_transport(
    facts: Sequence[Mapping[str, Any]], backend: str, per_node: Mapping[int, Mapping[str, Any] | None], note: str = ""
) -> Verdict:
    """gloo: TCP, always. nccl: what NCCL's log said (``per_node``: parse_nccl_log's result per node,
    None where no log could be read, with ``note`` saying why)."""
    ib = ib_wanted(facts)
    if backend != "nccl":
        level = WARN if ib else PASS
        return Verdict(
            "transport",
            all_nodes(facts, level),
            "gloo: TCP sockets (ddp-lab's gloo has no RDMA path)",
            "InfiniBand needs NCCL: run on GPUs with BACKEND=nccl" if ib else "",
        )
    status, parts, fixes = all_nodes(facts, PASS), [], []
    multi_node = len(nodes_of(facts)) > 1
    for node in nodes_of(facts):
        found = per_node.get(node)
        if not found or not (found.get("network") or found.get("transports")):
            status[node] = SKIP
            parts.append(f"node{node}: unknown")
            continue
        kinds = list(found["transports"])
        network = found.get("network") or "?"
        if network == "IB" and found.get("link_layers"):
            network = "IB (" + "/".join(found["link_layers"]) + ")"
        parts.append(f"node{node}: network {network}, channels via {', '.join(kinds) or '?'}")
        on_sockets = found.get("network") == "Socket" or "NET/Socket" in kinds
        if multi_node and on_sockets:
            status[node] = FAIL if ib else WARN
            fixes.append(
                f"node{node} talks over TCP sockets: "
                + (
                    "NCCL found no usable IB adapter (check the devices, NCCL_IB_HCA, memlock)"
                    if ib
                    else "fine without InfiniBand; if the hosts have it, expose it and set NCCL_IB_DISABLE=0"
                )
            )
    if all(s == SKIP for s in status.values()):
        return Verdict("transport", status, note or "NCCL's log named no transport", "")
    return Verdict("transport", status, "; ".join(parts), "; ".join(fixes))
