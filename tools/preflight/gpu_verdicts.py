"""Preflight's GPU rows: the devices each rank sees, their compute capability, the driver, memory in use."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ddp_core.distributed.cuda import arch_runs_on
from tools.preflight.probes import version_pair
from tools.preflight.verdict import (
    FAIL,
    NO_CUDA,
    PASS,
    SKIP,
    WARN,
    Verdict,
    all_nodes,
    memory_size,
    nodes_of,
    ranks_text,
    ranks_where,
    worst,
)


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
            out.append(f"{ranks_where(facts, [fact['rank']])}: no CUDA while other ranks have it")
        elif "error" in fact["gpu"]:
            status[fact["node"]] = WARN
            out.append(f"{ranks_where(facts, [fact['rank']])}: could not query its GPU ({fact['gpu']['error']})")
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
        names = sorted({f"{g['name']} ({memory_size(g['memory_bytes'])})" for g in gpus})
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
                f"{ranks_where(facts, [fact['rank']])}: {gpu['name']} is {sm}, "
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
        where = ranks_where(facts, [fact["rank"]])
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
                f"{ranks_where(facts, [fact['rank']])}: {memory_size(foreign)} of {gpu['name']} in use beyond this "
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
        else f"at most {memory_size(largest)} in use beyond each rank's own "
        f"(threshold {memory_size(foreign_limit_bytes)})"
    )
    return Verdict("gpu_memory", status, detail, fix)
