"""The preflight's network row (tools/preflight/verdicts.check_network) over made-up probe reports."""

from __future__ import annotations

from typing import Any

import pytest

from tools.preflight import table, verdicts


def node(
    n: int,
    interface: str = "eth0",
    yours: bool = False,
    problem: str | None = None,
    unreachable: dict[int, str] | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    choice = (
        None
        if problem
        else {
            "variable": "GLOO_SOCKET_IFNAME",
            "value": interface,
            "interface": interface,
            "address": f"10.0.0.{n + 1}" if address is None else address,
            "reason": "",
            "yours": yours,
        }
    )
    return {"node": n, "host": f"host{n}", "choice": choice, "problem": problem, "unreachable": unreachable or {}}


NO_ROUTE = "No route to host after 0.0 s"
SILENT = "no answer within 5 s (a firewall dropping packets, or no route back)"

CASES = [
    # (case, reports, statuses by node, words in the detail, words in the fix)
    (
        "two nodes reach each other",
        [node(0), node(1, "eth1", yours=True)],
        {0: "PASS", 1: "PASS"},
        ["node0 eth0 10.0.0.1 (chosen)", "node1 eth1 10.0.0.2 (yours)", "every node reaches every other"],
        [],
    ),
    (
        "three nodes, the last cut off",
        [
            node(0, unreachable={2: SILENT}),
            node(1, unreachable={2: SILENT}),
            node(2, unreachable={0: NO_ROUTE, 1: NO_ROUTE}),
        ],
        {0: "FAIL", 1: "FAIL", 2: "FAIL"},
        ["node2 -> node0: No route to host", "node0 -> node2: no answer"],
        ["node2 (host2) cannot reach the other nodes on eth0"],
    ),
    (
        "two nodes, node 1's own route refuses",
        [node(0, unreachable={1: SILENT}), node(1, unreachable={0: NO_ROUTE})],
        {0: "FAIL", 1: "FAIL"},
        ["node1 -> node0: No route to host"],
        ["node1 (host1) cannot reach", "GLOO_SOCKET_IFNAME on every node"],
    ),
    (
        "two nodes, both silent: both named",
        [node(0, unreachable={1: SILENT}), node(1, unreachable={0: SILENT})],
        {0: "FAIL", 1: "FAIL"},
        ["node0 -> node1", "node1 -> node0"],
        ["node0 (host0) and node1 (host1) cannot reach"],
    ),
    (
        "a node that could not choose",
        [node(0), node(1, problem="GLOO_SOCKET_IFNAME='lo' is the loopback interface, which ...")],
        {0: "PASS", 1: "FAIL"},
        ["node1 (host1): GLOO_SOCKET_IFNAME='lo' is the loopback interface"],
        ["node1 (host1): GLOO_SOCKET_IFNAME='lo'"],
    ),
    (
        "an NCCL exclusion pattern is not probed",
        [node(0), node(1, "^docker", yours=True, address="")],
        {0: "PASS", 1: "SKIP"},
        ["node1 ^docker (yours)"],
        [],
    ),
]


@pytest.mark.parametrize("case,reports,statuses,detail_words,fix_words", CASES, ids=[c[0] for c in CASES])
def test_network_row(case, reports, statuses, detail_words, fix_words):
    verdict = verdicts.check_network(reports, [r["node"] for r in reports])
    assert verdict.nodes == statuses
    for word in detail_words:
        assert word in verdict.detail, verdict.detail
    for word in fix_words:
        assert word in verdict.fix, verdict.fix
    assert bool(verdict.fix) is (verdict.status == "FAIL")
    assert verdict.data["nodes"] == reports


def test_one_node_is_skipped():
    verdict = verdicts.check_network([], [0])
    assert verdict.nodes == {0: "SKIP"} and "one node" in verdict.detail


def test_the_failed_row_renders_with_its_fix():
    reports = [node(0, unreachable={1: SILENT}), node(1, unreachable={0: NO_ROUTE})]
    verdict = verdicts.check_network(reports, [0, 1])
    facts = [{"rank": r, "node": r // 2, "host": f"host{r // 2}"} for r in range(4)]
    printed = table.render_table([verdict], facts, "preflight: 2 node(s), 4 rank(s)")
    assert "network  FAIL   FAIL" in printed
    assert "FAIL network: node1 (host1) cannot reach the other nodes on eth0" in printed
    assert "preflight FAILED: 0 PASS, 0 WARN, 1 FAIL, 0 SKIP" in printed
