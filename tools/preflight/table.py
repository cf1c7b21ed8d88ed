"""Preflight's output on global rank 0: the table (a row per check, a column per node) and the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.preflight.verdict import FAIL, PASS, SKIP, WARN, Verdict, nodes_of, ranks_text

MAX_NODE_COLUMNS = 12  # more nodes than this: one column holding the worst status of all nodes


def node_labels(facts: Sequence[Mapping[str, Any]]) -> list[str]:
    host = {f["node"]: f["host"] for f in sorted(facts, key=lambda f: f["rank"])}
    return [f"node{node} = {host[node]} ({ranks_text(ranks)})" for node, ranks in nodes_of(facts).items()]


def render_table(verdicts: Sequence[Verdict], facts: Sequence[Mapping[str, Any]], title: str) -> str:
    """One table: a row per check, a column per node (the worst status of its ranks), the detail; then one
    line per FAIL (and WARN) saying how to fix it."""
    nodes = list(nodes_of(facts))
    columns = [f"node{n}" for n in nodes] if len(nodes) <= MAX_NODE_COLUMNS else [f"{len(nodes)} nodes"]

    def cells(v: Verdict) -> list[str]:
        if len(nodes) <= MAX_NODE_COLUMNS:
            return [v.nodes.get(n, SKIP) for n in nodes]
        return [v.status]

    name_width = max(len("check"), *(len(v.name) for v in verdicts))
    widths = [max(len(c), 4) for c in columns]
    lines = [title, "  " + "; ".join(node_labels(facts)), ""]
    header = "  ".join([f"{'check':<{name_width}}", *(f"{c:<{w}}" for c, w in zip(columns, widths)), "detail"])
    lines += [header, "-" * len(header)]
    for v in verdicts:
        lines.append("  ".join([f"{v.name:<{name_width}}", *(f"{c:<{w}}" for c, w in zip(cells(v), widths)), v.detail]))
    fails = [v for v in verdicts if v.status == FAIL]
    warns = [v for v in verdicts if v.status == WARN and v.fix]
    if fails or warns:
        lines.append("")
    for v in fails:
        lines.append(f"FAIL {v.name}: {v.fix or v.detail}")
    for v in warns:
        lines.append(f"WARN {v.name}: {v.fix}")
    counts = {s: sum(v.status == s for v in verdicts) for s in (PASS, WARN, FAIL, SKIP)}
    lines += [
        "",
        "preflight " + ("FAILED" if fails else "passed") + ": " + ", ".join(f"{n} {s}" for s, n in counts.items()),
    ]
    return "\n".join(lines)


def report(
    verdicts: Sequence[Verdict], facts: Sequence[Mapping[str, Any]], backend: str, device: str, exit_code: int
) -> dict[str, Any]:
    """The JSON document: the same rows as the table, plus the layout."""
    return {
        "ok": not any(v.status == FAIL for v in verdicts),
        "exit_code": exit_code,
        "world": {"world_size": len(facts), "nodes": len(nodes_of(facts)), "backend": backend, "device": device},
        "nodes": [
            {"node": node, "host": next(f["host"] for f in facts if f["node"] == node), "ranks": ranks}
            for node, ranks in nodes_of(facts).items()
        ],
        "checks": [v.as_dict() for v in verdicts],
    }


def dumps(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False, default=str) + "\n"


def write_json(path_text: str, document: dict[str, Any]) -> bool:
    """Rank 0: the report as JSON; False (and one line) when the file cannot be written."""
    path = Path(path_text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(document))
    except OSError as error:  # every rank still finishes together, and the exit code says it failed
        print(
            f"error: --json {path}: {error.strerror or error}: choose a file this user can write",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True
