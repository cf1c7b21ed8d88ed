"""Preflight's verdicts: pure functions over every rank's facts and measurements, one row of the table each.

Nothing here needs a process group: ``tools.preflight.main`` gathers the facts (``tools.preflight.probes``)
and the measurements, and calls the verdicts on global rank 0.

A verdict is one row of preflight's table: a status per node (PASS, WARN, FAIL or SKIP), one line of
detail, and for a FAIL or WARN one line saying how to fix it. A node's status is the worst of its ranks'.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from ddp_core.distributed.cuda import arch_runs_on
from tools.preflight.probes import version_pair

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


def _by_node(facts: Sequence[Mapping[str, Any]], ranks: Iterable[int]) -> dict[int, list[int]]:
    node_of = {f["rank"]: f["node"] for f in facts}
    out: dict[int, list[int]] = {}
    for rank in sorted(set(ranks)):
        out.setdefault(node_of[rank], []).append(rank)
    return out


def _where(facts: Sequence[Mapping[str, Any]], ranks: Iterable[int]) -> str:
    """'node1 (ranks 2-3)', several nodes joined with ', '."""
    return ", ".join(f"node{node} ({ranks_text(r)})" for node, r in _by_node(facts, ranks).items())


def _memory_size(count: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"


# ---------------------------------------------------------------------------------------------------
# Verdicts: every rank's facts -> one row


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
    detail = "; ".join(f"{_where(facts, ranks)}: {text}" for text, ranks in first.items())
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
                + "; ".join(f"{c} on {_where(facts, r)}" for c, r in by_commit.items()),
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
        "; ".join(f"{_where(facts, ranks)}: {named}" for named, ranks in groups.items())
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
        shown = "; ".join(f"{'unset' if v is None else repr(v)} on {_where(facts, r)}" for v, r in by_value.items())
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

    ``reports``: ``network.probe_reachability``'s NodeReport of every node, as dicts; empty on one node.
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


def _gpu_rows(facts: Sequence[Mapping[str, Any]]) -> tuple[dict[int, str], list[Mapping[str, Any]]] | None:
    """None when no rank runs on CUDA (the GPU rows are SKIP); else a per-node status start and the ranks' GPU facts."""
    if all(f["gpu"] is None for f in facts):
        return None
    return all_nodes(facts, PASS), [f for f in facts if f["gpu"] is not None]


def _gpu_skipped(facts: Sequence[Mapping[str, Any]], name: str) -> Verdict:
    on_cpu = "skipped: the job runs on CPU (gloo)" if any(f.get("cuda_available") for f in facts) else NO_CUDA
    return Verdict(name, all_nodes(facts, SKIP), on_cpu)


def _gpu_errors(facts: Sequence[Mapping[str, Any]], status: dict[int, str]) -> list[str]:
    out = []
    for fact in facts:
        if fact["gpu"] is None:
            status[fact["node"]] = FAIL
            out.append(f"{_where(facts, [fact['rank']])}: no CUDA while other ranks have it")
        elif "error" in fact["gpu"]:
            status[fact["node"]] = WARN
            out.append(f"{_where(facts, [fact['rank']])}: could not query its GPU ({fact['gpu']['error']})")
    return out


def check_gpu_devices(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    rows = _gpu_rows(facts)
    if rows is None:
        return _gpu_skipped(facts, "gpu_devices")
    status, _ = rows
    problems = _gpu_errors(facts, status)
    fixes = []
    if any(f["gpu"] is None for f in facts):
        fixes.append("give every node GPUs, or run with BACKEND=gloo everywhere")
    described = []
    for node, ranks in nodes_of(facts).items():
        queried = [f for f in facts if f["node"] == node and f["gpu"] and "error" not in f["gpu"]]
        gpus = [f["gpu"] for f in queried]
        by_id: dict[str, list[int]] = {}
        for fact in queried:
            by_id.setdefault(fact["gpu"]["id"], []).append(fact["rank"])
        for gpu_id, sharing in by_id.items():
            if len(sharing) > 1:
                status[node] = FAIL
                problems.append(f"node{node}: {ranks_text(sharing)} share one GPU ({gpu_id})")
                fixes.append(
                    "give each local rank its own GPU: --nproc-per-node at most the GPUs visible, "
                    "and check CUDA_VISIBLE_DEVICES"
                )
        names = sorted({f"{g['name']} ({_memory_size(g['memory_bytes'])})" for g in gpus})
        described.append(f"node{node}: {len(gpus)}x {' + '.join(names)}")
    models = {g["gpu"]["name"] for g in facts if g["gpu"] and "error" not in g["gpu"]}
    if len(models) > 1 and not problems:
        for node in status:
            status[node] = worst((status[node], WARN))
        problems.append("different GPU models: the slowest sets the pace of every step")
        fixes.append("use one GPU model for the whole job")
    detail = "; ".join(problems) if problems else "; ".join(described)
    return Verdict("gpu_devices", status, detail, "; ".join(dict.fromkeys(fixes)))


def capability_support(capability: Sequence[int], arch_list: Sequence[str]) -> str:
    """PASS: this torch has machine code (sm_XY) that runs on the GPU; WARN: only PTX (compute_XY), compiled
    by the driver at start-up; FAIL: neither. The rules are ddp_core.distributed.cuda's (sm_80 runs on 8.6,
    sm_90a on 9.0 only)."""
    runs = [entry for entry in arch_list if arch_runs_on(entry, (int(capability[0]), int(capability[1])))]
    if any(entry.startswith("sm_") for entry in runs):
        return PASS
    return WARN if runs else FAIL


def check_gpu_capability(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    rows = _gpu_rows(facts)
    if rows is None:
        return _gpu_skipped(facts, "gpu_capability")
    status, gpus = rows
    problems = _gpu_errors(facts, status)
    seen = []
    for fact in gpus:
        gpu = fact["gpu"]
        if "error" in gpu:
            continue
        verdict = capability_support(gpu["capability"], gpu["arch_list"])
        status[fact["node"]] = worst((status[fact["node"]], verdict))
        sm = f"sm_{gpu['capability'][0]}{gpu['capability'][1]}"
        if verdict != PASS:
            problems.append(
                f"{_where(facts, [fact['rank']])}: {gpu['name']} is {sm}, "
                f"torch {torch.__version__} has {' '.join(gpu['arch_list']) or 'no CUDA kernels'}"
                + (" (PTX only: JIT-compiled at start-up)" if verdict == WARN else "")
            )
        seen.append(sm)
    fix = (
        "install a torch build whose CUDA arch list includes this GPU's sm_XY (torch.cuda.get_arch_list())"
        if problems
        else ""
    )
    return Verdict(
        "gpu_capability",
        status,
        "; ".join(problems) if problems else f"supported by this torch: {', '.join(sorted(set(seen)))}",
        fix,
    )


def check_gpu_driver(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    """The driver must support torch's CUDA runtime: an older major version cannot run it; an older minor
    one runs it under CUDA's minor-version compatibility, without PTX JIT (WARN)."""
    rows = _gpu_rows(facts)
    if rows is None:
        return _gpu_skipped(facts, "gpu_driver")
    status, gpus = rows
    problems = _gpu_errors(facts, status)
    seen = set()
    for fact in gpus:
        gpu = fact["gpu"]
        if "error" in gpu:
            continue
        driver, runtime = version_pair(gpu["driver_cuda"]), version_pair(gpu["runtime_cuda"])
        where = _where(facts, [fact["rank"]])
        if driver is None or runtime is None:
            status[fact["node"]] = worst((status[fact["node"]], WARN))
            problems.append(f"{where}: could not read the driver's CUDA version (libcuda cuDriverGetVersion)")
            continue
        seen.add(f"driver supports CUDA {gpu['driver_cuda']}, torch built for {gpu['runtime_cuda']}")
        if driver[0] < runtime[0]:
            status[fact["node"]] = FAIL
            problems.append(
                f"{where}: the driver supports CUDA {gpu['driver_cuda']}, torch needs {gpu['runtime_cuda']}"
            )
        elif driver < runtime:
            status[fact["node"]] = worst((status[fact["node"]], WARN))
            problems.append(
                f"{where}: driver CUDA {gpu['driver_cuda']} < {gpu['runtime_cuda']} "
                "(minor-version compatibility: no PTX JIT)"
            )
    fix = (
        (
            "upgrade the NVIDIA driver on the named nodes to one supporting torch's CUDA version "
            "(nvidia-smi shows it), or install a torch built for an older CUDA"
        )
        if problems
        else ""
    )
    return Verdict("gpu_driver", status, "; ".join(problems) if problems else "; ".join(sorted(seen)), fix)


def check_gpu_memory(facts: Sequence[Mapping[str, Any]], foreign_limit_bytes: int) -> Verdict:
    """Memory in use on the device beyond what this process's allocator holds. It includes this
    process's CUDA context and NCCL's buffers (a few hundred MiB), hence a threshold, not zero."""
    rows = _gpu_rows(facts)
    if rows is None:
        return _gpu_skipped(facts, "gpu_memory")
    status, gpus = rows
    problems = _gpu_errors(facts, status)
    largest = 0
    for fact in gpus:
        gpu = fact["gpu"]
        if "error" in gpu:
            continue
        foreign = gpu["used_bytes"] - gpu["own_bytes"]
        largest = max(largest, foreign)
        if foreign > foreign_limit_bytes:
            status[fact["node"]] = worst((status[fact["node"]], WARN))
            problems.append(
                f"{_where(facts, [fact['rank']])}: {_memory_size(foreign)} of {gpu['name']} in use beyond this "
                "process's own"
            )
    fix = (
        (
            "another process may hold these GPUs: `nvidia-smi` lists them; stop them, or raise --gpu-foreign-mib "
            "if this is the job's own context"
        )
        if problems
        else ""
    )
    detail = (
        "; ".join(problems)
        if problems
        else f"at most {_memory_size(largest)} in use beyond each rank's own "
        f"(threshold {_memory_size(foreign_limit_bytes)})"
    )
    return Verdict("gpu_memory", status, detail, fix)


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
            parts.append(f"node{node}: {_memory_size(shm['total_bytes'])}")
            small.append(node)
        else:
            status[node] = PASS
            parts.append(f"node{node}: {_memory_size(shm['total_bytes'])}")
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
            parts.append(f"node{node}: only {_memory_size(free)} free at {d['checked_at']}")
            fixes.append(
                f"free space at {d['checked_at']} on node{node} (at least --min-free-gib {min_free_bytes / GIB:g})"
            )
        else:
            status[node] = PASS
            parts.append(f"node{node}: writable, {_memory_size(free) if free is not None else '?'} free")
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


def _ib_wanted(facts: Sequence[Mapping[str, Any]]) -> bool:
    return any(f["ib_requested"] for f in facts)


IB_NOT_ASKED = "skipped: InfiniBand not asked for (--expect-ib or NCCL_IB_DISABLE=0)"


def check_memlock(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    if not _ib_wanted(facts):
        return Verdict("memlock", all_nodes(facts, SKIP), IB_NOT_ASKED)
    status, parts = {}, []
    for node, m in _host(facts, "memlock").items():
        if m is None or "error" in m:
            status[node], text = WARN, f"node{node}: unknown"
        elif m["soft"] is None:
            status[node], text = PASS, f"node{node}: unlimited"
        else:
            status[node] = WARN if m["soft"] >= GIB else FAIL
            text = f"node{node}: {_memory_size(m['soft'])}"
        parts.append(text)
    bad = any(s != PASS for s in status.values())
    fix = (
        "RDMA pins memory: `ulimit -l unlimited` (docker run --ulimit memlock=-1, compose ulimits: memlock: -1)"
        if bad
        else ""
    )
    return Verdict("memlock", status, "locked-memory limit " + ", ".join(parts), fix)


def check_infiniband(facts: Sequence[Mapping[str, Any]]) -> Verdict:
    if not _ib_wanted(facts):
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
        status[_by_node(facts, [rank]).popitem()[0]] = FAIL
    if wrong:
        return Verdict(
            "all_reduce",
            status,
            f"wrong sum on {_where(facts, wrong)}",
            "a wrong result means broken hardware or a broken library: rerun with NCCL_DEBUG=WARN "
            "and test the named nodes' GPUs/NICs alone",
        )
    return Verdict(
        "all_reduce",
        status,
        f"{len(facts)} ranks, {_memory_size(nbytes)} int64: exact sum, {seconds * 1e3:.1f} ms",
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
    ib = _ib_wanted(facts)
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
