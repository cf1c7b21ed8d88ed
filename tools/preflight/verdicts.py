"""Preflight's verdicts: pure functions over every rank's facts and measurements, one row of the table each.

Nothing here needs a process group: ``tools.preflight.main`` gathers the facts (``tools.preflight.probes``)
and the measurements, and calls the verdicts on global rank 0. This module holds the rows about the software
and the hosts, and names the GPU rows (gpu_verdicts.py) and the link rows (link_verdicts.py) too.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tools.preflight.gpu_verdicts import (  # noqa: F401 (the table's rows, by one name)
    capability_support,
    check_gpu_capability,
    check_gpu_devices,
    check_gpu_driver,
    check_gpu_memory,
)
from tools.preflight.link_verdicts import (  # noqa: F401
    check_all_reduce,
    check_bandwidth,
    check_clocks,
    check_network,
    check_transport,
)
from tools.preflight.verdict import (  # noqa: F401
    FAIL,
    GIB,
    MIB,
    PASS,
    PER_HOST_VARIABLES,
    SKIP,
    WARN,
    Verdict,
    all_nodes,
    ib_wanted,
    leaders,
    memory_size,
    nodes_of,
    ranks_text,
    ranks_where,
    worst,
)


def check_versions(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    reference = facts[0]["versions"]
    status = all_nodes(facts, PASS)
    differences = []
    for fact in facts:
        differ = [
            f"{key} {fact['versions'].get(key)} (rank 0: {reference.get(key)})"
            for key in ("python", "torch", "cuda", "nccl")
            if fact["versions"].get(key) != reference.get(key)
        ]
        if differ:
            status[fact["node"]] = FAIL
            differences.append((fact["rank"], ", ".join(differ)))
    described = ", ".join(f"{k} {v or '-'}" for k, v in reference.items())
    if not differences:
        return Verdict("versions", status, f"every rank: {described}")
    first: dict[str, list[int]] = {}
    for rank, text in differences:
        first.setdefault(text, []).append(rank)
    detail = "; ".join(f"{ranks_where(facts, ranks)}: {text}" for text, ranks in first.items())
    return Verdict(
        "versions",
        status,
        detail,
        "install the same versions on every node: the same image tag everywhere, "
        "or `make setup` from the same requirements*.txt",
    )


def diff_files(reference: Mapping[str, str], other: Mapping[str, str]) -> list[str]:
    """'path (edited)', 'path (missing here)', 'path (only here)' for each file that is not the same."""
    out = []
    for name in sorted(set(reference) | set(other)):
        if name not in other:
            out.append(f"{name} (missing here)")
        elif name not in reference:
            out.append(f"{name} (only here)")
        elif reference[name] != other[name]:
            out.append(f"{name} (edited)")
    return out


def check_code(
    facts: Sequence[Mapping[str, Any]], file_maps: Mapping[int, Mapping[str, str]] | None = None, max_named: int = 5
) -> Verdict:
    """Compare each rank's code digest with rank 0's; ``file_maps`` (rank -> per-file digests, rank 0's
    included) names the files where digests differ."""
    reference = facts[0]["code"]
    status = all_nodes(facts, PASS)
    differing = [f for f in facts if f["code"]["digest"] != reference["digest"]]
    commits = {f["code"]["commit"] for f in facts}
    commit_text = f"commit {reference['commit'][:12]}" if reference["commit"] else "no git"
    if not differing:
        if len(commits) > 1 and None not in commits:
            by_commit: dict[str, list[int]] = {}
            for f in facts:
                by_commit.setdefault(f["code"]["commit"][:12], []).append(f["rank"])
            for f in facts:
                if f["code"]["commit"] != reference["commit"]:
                    status[f["node"]] = WARN
            return Verdict(
                "code",
                status,
                f"the same {reference['files']} code files everywhere, but different commits: "
                + "; ".join(f"{c} on {ranks_where(facts, r)}" for c, r in by_commit.items()),
                "check out the same commit on every node (the code that runs is the same, so this is only a WARN)",
            )
        return Verdict(
            "code",
            status,
            f"the same {reference['files']} code files on every rank "
            f"({commit_text}, digest {reference['digest'][:12]})",
        )
    groups: dict[str, list[int]] = {}
    for fact in differing:
        status[fact["node"]] = FAIL
        rank = fact["rank"]
        named = "digest differs"
        if file_maps and rank in file_maps and 0 in file_maps:
            changes = diff_files(file_maps[0], file_maps[rank])
            named = ", ".join(changes[:max_named]) + (
                f" and {len(changes) - max_named} more" if len(changes) > max_named else ""
            )
        groups.setdefault(named, []).append(rank)
    detail = (
        "; ".join(f"{ranks_where(facts, ranks)}: {named}" for named, ranks in groups.items())
        + f" (compared with node{facts[0]['node']}, rank 0)"
    )
    return Verdict(
        "code",
        status,
        detail,
        "run the same ddp-lab code on every node: commit and pull (or rsync, or the same image tag) "
        "so the named files match, then run preflight again",
    )


def check_environment(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    names = sorted({name for f in facts for name in f["env"]})
    status = all_nodes(facts, PASS)
    problems, fixes, per_host = [], [], []
    for name in names:
        values = {f["rank"]: f["env"].get(name) for f in facts}
        if len(set(values.values())) == 1:
            continue
        level = WARN if name in PER_HOST_VARIABLES else FAIL
        reference = values[0]
        by_value: dict[str | None, list[int]] = {}
        for rank, value in values.items():
            by_value.setdefault(value, []).append(rank)
        for fact in facts:
            if values[fact["rank"]] != reference:
                status[fact["node"]] = worst((status[fact["node"]], level))
        shown = "; ".join(
            f"{'unset' if v is None else repr(v)} on {ranks_where(facts, r)}" for v, r in by_value.items()
        )
        problems.append(f"{name}: {shown}")
        (per_host if level == WARN else fixes).append(name)
    if not problems:
        shown = ", ".join(names) if names else "none set"
        return Verdict("environment", status, f"agree on every rank ({shown})")
    parts = (
        [f"set {', '.join(fixes)} the same on every node (each host's shell and .env; compose passes the host's)"]
        if fixes
        else []
    )
    if per_host:
        parts.append(
            f"{', '.join(per_host)} may legitimately differ per host (interface or adapter names): "
            "check that each names the right one"
        )
    fix = "; ".join(parts)
    return Verdict("environment", status, " | ".join(problems), fix)


def _host(facts: Sequence[Mapping[str, Any]], key: str) -> dict[int, Any]:
    """node -> its leader's host fact ``key``."""
    return {f["node"]: f["host_checks"][key] for f in facts if f["host_checks"] is not None}


def check_shm(facts: Sequence[Mapping[str, Any]], min_bytes: int) -> Verdict:
    status, parts, small = {}, [], []
    for node, shm in _host(facts, "shm").items():
        if "error" in shm or "total_bytes" not in shm:
            status[node] = WARN
            parts.append(f"node{node}: no {shm.get('path', '/dev/shm')} ({shm.get('error')})")
            small.append(node)
        elif shm["total_bytes"] < min_bytes:
            status[node] = WARN
            parts.append(f"node{node}: {memory_size(shm['total_bytes'])}")
            small.append(node)
        else:
            status[node] = PASS
            parts.append(f"node{node}: {memory_size(shm['total_bytes'])}")
    fix = (
        (
            "DataLoader workers pass batches through /dev/shm; Docker's default is 64 MB: --shm-size=8g, "
            f"compose shm_size, or ipc: host (threshold --min-shm-gib {min_bytes / GIB:g})"
        )
        if small
        else ""
    )
    return Verdict("shm", status, "; ".join(parts), fix)


def check_directory(
    facts: Sequence[Mapping[str, Any]], key: str, label: str, min_free_bytes: int, rank0_node: int
) -> Verdict:
    """run_dir: FAIL where rank 0 runs (it alone writes there), WARN on other nodes (rank 0 can move there
    under c10d rendezvous). data_dir: writing is only needed for --download, so WARN."""
    status, parts, fixes = {}, [], []
    for node, d in _host(facts, key).items():
        level = FAIL if key == "run_dir" and node == rank0_node else WARN
        if "error" in d and "writable" not in d:
            status[node] = WARN
            parts.append(f"node{node}: cannot check {d['error']}")
            continue
        free = d.get("free_bytes")
        if not d["writable"]:
            status[node] = level
            parts.append(f"node{node}: not writable ({d.get('error')})")
            fixes.append(
                f"make {d['path']} writable by this user on node{node} (or choose another --{label.replace('_', '-')})"
                + (": needed only for --download" if key == "data_dir" else "")
            )
        elif key == "run_dir" and free is not None and free < min_free_bytes:
            status[node] = level
            parts.append(f"node{node}: only {memory_size(free)} free at {d['checked_at']}")
            fixes.append(
                f"free space at {d['checked_at']} on node{node} (at least --min-free-gib {min_free_bytes / GIB:g})"
            )
        else:
            status[node] = PASS
            parts.append(f"node{node}: writable, {memory_size(free) if free is not None else '?'} free")
    path = next((d.get("path") for d in _host(facts, key).values()), "?")
    return Verdict(label, status, f"{path}: " + "; ".join(parts), "; ".join(fixes))


def check_dataset(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    found = _host(facts, "dataset")
    if all(d.get("dataset") == "none" for d in found.values()):
        return Verdict("dataset", {n: SKIP for n in found}, "skipped: no --dataset")
    status, parts, fixes = {}, [], []
    for node, d in found.items():
        if d.get("ok"):
            status[node] = PASS
            parts.append(
                f"node{node}: {d['dataset']} {d['train']} train + {d['test']} test images"
                + (", md5 verified" if d.get("verified") else ", not verified (--no-verify)")
            )
        else:
            status[node] = FAIL
            parts.append(f"node{node}: {d.get('error')}")
            fixes.append(f"node{node}: {d.get('error')}")
    return Verdict("dataset", status, "; ".join(parts), " | ".join(dict.fromkeys(f.split(": ", 1)[1] for f in fixes)))


IB_NOT_ASKED = "skipped: InfiniBand not asked for (--expect-ib or NCCL_IB_DISABLE=0)"


def check_memlock(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    if not ib_wanted(facts):
        return Verdict("memlock", all_nodes(facts, SKIP), IB_NOT_ASKED)
    status, parts = {}, []
    for node, m in _host(facts, "memlock").items():
        if m is None or "error" in m:
            status[node], text = WARN, f"node{node}: unknown"
        elif m["soft"] is None:
            status[node], text = PASS, f"node{node}: unlimited"
        else:
            status[node] = WARN if m["soft"] >= GIB else FAIL
            text = f"node{node}: {memory_size(m['soft'])}"
        parts.append(text)
    bad = any(s != PASS for s in status.values())
    fix = (
        "RDMA pins memory: `ulimit -l unlimited` (docker run --ulimit memlock=-1, compose ulimits: memlock: -1)"
        if bad
        else ""
    )
    return Verdict("memlock", status, "locked-memory limit " + ", ".join(parts), fix)


def check_infiniband(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    if not ib_wanted(facts):
        return Verdict("infiniband", all_nodes(facts, SKIP), IB_NOT_ASKED)
    status, parts = {}, []
    for node, ib in _host(facts, "infiniband").items():
        if ib and ib.get("adapters") and ib.get("devices"):
            status[node] = PASS
            parts.append(f"node{node}: {', '.join(ib['adapters'])}")
        else:
            status[node] = FAIL
            missing = (
                "no adapters in /sys/class/infiniband"
                if not (ib and ib.get("adapters"))
                else "no /dev/infiniband devices"
            )
            parts.append(f"node{node}: {missing}")
    fix = (
        (
            "expose the adapters to the job (docker: --device=/dev/infiniband --cap-add=IPC_LOCK, "
            "or the RDMA device plugin), or drop --expect-ib / NCCL_IB_DISABLE=0 to use sockets"
        )
        if any(s == FAIL for s in status.values())
        else ""
    )
    return Verdict("infiniband", status, "; ".join(parts), fix)
