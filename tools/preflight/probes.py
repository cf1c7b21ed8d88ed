"""Preflight's probes: what each rank finds out about itself (facts), and what the ranks measure together.

Facts need no process group: versions, the code's digests, the watched variables, the GPU, and on each
node's local rank 0 the host (shared memory, the directories, the dataset, memlock, InfiniBand). They are
plain dicts, picklable and JSON-able whatever the version of this file on another node: the code check must
still work when this very file differs. The measurements (clock offsets, an all_reduce, the bandwidth
between nodes) run inside the process group; ``tools.preflight.verdicts`` judges both on global rank 0.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from ddp_core.distributed.cuda import nvml_driver

if TYPE_CHECKING:
    from ddp_core.distributed.group import DistContext

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# What the Docker image holds (.dockerignore)
CODE_PATHS = ("ddp_core", "experiments", "tools", "requirements.txt")
# Variables every rank must agree on (tools.preflight.verdicts: a few per-host ones differ with only a WARN).
AGREED_VARIABLES = ("SEED", "DETERMINISTIC", "BACKEND", "DIST_TIMEOUT_S", "DIST_INIT_TIMEOUT_S")
AGREED_PREFIXES = ("NCCL_",)
CLOCK_ROUND_TRIPS = 5
REDUCE_NUMEL = 1 << 18  # 2 MiB of int64: several chunks on every backend, milliseconds on CPU


# ---------------------------------------------------------------------------------------------------
# Facts: what one rank finds out about itself (no collectives)


def versions() -> dict[str, str | None]:
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}


def _git(root: Path, *args: str) -> str | None:
    if not (root / ".git").exists():
        return None
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def code_files(root: Path = PROJECT_ROOT) -> tuple[str, list[str]]:
    """The code a run executes, as paths relative to ``root``, and where the list came from.

    The files the image holds: ddp_core/, experiments/ and requirements.txt. In a git checkout, git says
    which of them are the project's (tracked, or new and not ignored: a new experiment counts); without
    git (the Docker image), every file there except caches.
    """
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *CODE_PATHS)
    if listed is not None:
        names = {name for name in listed.split("\0") if name}
        source = "git"
    else:
        names = set()
        for top in CODE_PATHS:
            path = root / top
            if path.is_file():
                names.add(top)
            for found in path.rglob("*") if path.is_dir() else ():
                if found.is_file():
                    names.add(found.relative_to(root).as_posix())
        source = "files"
    keep = [n for n in names if "__pycache__" not in n.split("/") and not n.endswith((".pyc", ".pyo"))]
    return source, sorted(keep)


def file_digests(root: Path = PROJECT_ROOT) -> tuple[str, dict[str, str]]:
    """(source, {path: sha256 of its bytes}); a listed file that is gone (deleted, not committed) is 'missing'."""
    source, names = code_files(root)
    digests = {}
    for name in names:
        try:
            digests[name] = hashlib.sha256((root / name).read_bytes()).hexdigest()
        except OSError:
            digests[name] = "missing"
    return source, digests


def overall_digest(digests: Mapping[str, str]) -> str:
    text = "".join(f"{name}\0{digest}\n" for name, digest in sorted(digests.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def code_facts(root: Path = PROJECT_ROOT) -> tuple[dict[str, Any], dict[str, str]]:
    """(the compact facts every rank shares, the per-file digests kept until they are asked for)."""
    source, digests = file_digests(root)
    commit = _git(root, "rev-parse", "HEAD")
    return {
        "root": str(root),
        "source": source,
        "commit": commit.strip() if commit else None,
        "digest": overall_digest(digests),
        "files": len(digests),
    }, digests


def watched_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that must agree across ranks and are set here."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name in AGREED_VARIABLES or name.startswith(AGREED_PREFIXES)
    }


def ib_requested(environ: Mapping[str, str], expect_ib: bool) -> bool:
    """The user asked for InfiniBand: --expect-ib, or NCCL_IB_DISABLE=0 set explicitly."""
    return expect_ib or environ.get("NCCL_IB_DISABLE", "").strip() == "0"


def _libcuda_driver_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion), or None without a driver."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return version.value // 1000, (version.value % 1000) // 10
    return None


def version_pair(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version such as "13.0" or "575.51.03"; None when there is none."""
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA the driver runs: NVML's answer (ddp_core.distributed.cuda), else libcuda's."""
    driver = nvml_driver()
    parsed = version_pair(driver.cuda if driver else None)
    return parsed or _libcuda_driver_version()


def gpu_facts(local_rank: int, device_index: int | None = None) -> dict[str, Any] | None:
    """This rank's GPU as torch sees it, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    bus = getattr(props, "pci_bus_id", None)
    identity = (
        str(uuid)
        if uuid
        else (
            f"pci {getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}"
            if bus is not None
            else f"index {index}"
        )
    )
    free, total = torch.cuda.mem_get_info(index)
    driver = driver_cuda_version()
    return {
        "local_rank": local_rank,
        "index": index,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "id": identity,
        "name": props.name,
        "memory_bytes": int(props.total_memory),
        "capability": [int(props.major), int(props.minor)],
        "arch_list": list(torch.cuda.get_arch_list()),
        "runtime_cuda": torch.version.cuda,
        "driver_cuda": f"{driver[0]}.{driver[1]}" if driver else None,
        "used_bytes": int(total - free),
        "own_bytes": int(torch.cuda.memory_reserved(index)),
    }


def shm_facts(path: str = "/dev/shm") -> dict[str, Any]:
    try:
        stat = os.statvfs(path)
    except OSError as error:
        return {"path": path, "error": error.strerror or str(error)}
    return {"path": path, "total_bytes": stat.f_blocks * stat.f_frsize, "free_bytes": stat.f_bavail * stat.f_frsize}


def directory_facts(path: str | Path) -> dict[str, Any]:
    """Can this process write at ``path``, and how much room is there: a temp file is created and removed.

    A missing directory is checked at its nearest existing ancestor (the run creates it there); nothing
    is left behind.
    """
    path = Path(path)
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    facts: dict[str, Any] = {"path": str(path), "checked_at": str(existing), "exists": path.exists()}
    if not existing.is_dir():
        return {**facts, "writable": False, "error": f"{existing} is not a directory"}
    try:
        facts["free_bytes"] = shutil.disk_usage(existing).free
    except OSError as error:
        facts["free_bytes"] = None
        facts["error"] = error.strerror or str(error)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".ddp-lab-preflight-", delete=True) as handle:
            handle.write(b"preflight")
            handle.flush()
            os.fsync(handle.fileno())
        facts["writable"] = True
    except OSError as error:
        facts["writable"] = False
        facts["error"] = f"{error.strerror or error} ({existing})"
    return facts


def dataset_facts(dataset: str, data_dir: str | Path, verify: bool) -> dict[str, Any]:
    """Load and check the dataset with the experiment's own reader (md5 sums too, when ``verify``)."""
    if dataset == "none":
        return {"dataset": "none"}
    if dataset != "cifar10":
        return {"dataset": dataset, "ok": False, "error": f"unknown dataset {dataset!r}"}
    from ddp_core.errors import ConfigError

    # The dataset is the experiment's, checked with its own reader (here, not at the top: only --dataset cifar10
    # needs it).
    from experiments import cifar10_data

    try:
        train = cifar10_data.load_split(data_dir, train=True, verify=verify)
        test = cifar10_data.load_split(data_dir, train=False, verify=verify)
    except ConfigError as error:
        return {"dataset": dataset, "ok": False, "error": str(error)}
    return {
        "dataset": dataset,
        "ok": True,
        "train": len(train.labels),
        "test": len(test.labels),
        "folder": str(cifar10_data.dataset_folder(data_dir)),
        "verified": verify,
    }


def memlock_facts() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    return {"soft": None if soft == unlimited else soft, "hard": None if hard == unlimited else hard}


def infiniband_facts(sys_dir: str = "/sys/class/infiniband", dev_dir: str = "/dev/infiniband") -> dict[str, Any]:
    def listing(path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    return {"adapters": listing(sys_dir), "devices": listing(dev_dir)}


def host_facts(args: Any, want_ib: bool) -> dict[str, Any]:
    """What one rank per node looks at: shared memory, the directories, the dataset, memlock, InfiniBand."""
    return {
        "shm": safely(shm_facts),
        "run_dir": safely(lambda: directory_facts(args.run_dir or "runs")),
        "data_dir": safely(lambda: directory_facts(args.data_dir)),
        "dataset": safely(lambda: dataset_facts(args.dataset, args.data_dir, args.verify)),
        "memlock": safely(memlock_facts) if want_ib else None,
        "infiniband": safely(infiniband_facts) if want_ib else None,
    }


def safely(collect: Callable[[], Any]) -> Any:
    """A collector's result, or {'error': ...}: one odd system must not stop every other check."""
    try:
        return collect()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def rank_facts(
    args: Any, rank: int, local_rank: int, node: int, environ: Mapping[str, str], device_type: str = "cpu"
) -> tuple[dict[str, Any], dict[str, str]]:
    """This rank's facts, and its per-file code digests (kept local until rank 0 asks for them).

    The GPU facts only where the job runs on CUDA (``device_type``): under BACKEND=gloo on a GPU machine
    every rank would report device 0 and seem to share it."""
    code, digests = code_facts()
    want_ib = ib_requested(environ, args.expect_ib)
    facts = {
        "rank": rank,
        "local_rank": local_rank,
        "node": node,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "versions": versions(),
        "code": code,
        "env": watched_environment(environ),
        "ib_requested": want_ib,
        "cuda_available": torch.cuda.is_available(),
        "gpu": safely(lambda: gpu_facts(local_rank)) if device_type == "cuda" else None,
        "host_checks": host_facts(args, want_ib) if local_rank == 0 else None,
        "time": time.time(),
    }
    return facts, digests


# ---------------------------------------------------------------------------------------------------
# Measurements: every rank takes part, inside the process group


def clock_offset(sent: float, remote: float, received: float) -> tuple[float, float]:
    """(offset of the remote clock, uncertainty): the remote time against the round trip's midpoint."""
    return remote - (sent + received) / 2, (received - sent) / 2


def measure_clocks(ctx: DistContext, leaders: dict[int, int]) -> dict[int, tuple[float, float]]:
    """Rank 0 and each other node's leader, in turn: rank 0 sends, the leader answers with its time.time().
    Of CLOCK_ROUND_TRIPS exchanges the one with the shortest round trip (the tightest bound) is kept."""
    offsets: dict[int, tuple[float, float]] = {}
    ping, pong = (
        torch.zeros(1, dtype=torch.float64, device=ctx.device) for _ in range(2)
    )  # never one buffer for both directions
    for node, leader in leaders.items():
        if leader == 0:
            continue
        best = None
        for _ in range(CLOCK_ROUND_TRIPS):
            if ctx.rank == 0:  # the two ends of the exchange, by their ranks in the group
                sent = time.time()
                dist.send(ping, dst=leader)
                dist.recv(pong, src=leader)
                remote = pong.item()  # waits for the answer on CUDA too
                received = time.time()
                estimate = clock_offset(sent, remote, received)
                best = estimate if best is None or estimate[1] < best[1] else best
            elif ctx.rank == leader:
                dist.recv(ping, src=0)
                ping.item()
                pong.fill_(time.time())
                dist.send(pong, dst=0)
        if best is not None:
            offsets[node] = best
    return offsets


def reduce_input(rank: int, numel: int) -> torch.Tensor:
    """Rank-unique values: element i of rank r is (r + 1) + i * 7 (int64, exact on every backend)."""
    return torch.arange(numel, dtype=torch.int64) * 7 + (rank + 1)


def reduce_expected(world_size: int, numel: int) -> torch.Tensor:
    """The closed-form sum over ranks: W (W + 1) / 2 + 7 i W."""
    return torch.arange(numel, dtype=torch.int64) * 7 * world_size + world_size * (world_size + 1) // 2


def measure_all_reduce(ctx: DistContext) -> tuple[bool, float]:
    tensor = reduce_input(ctx.rank, REDUCE_NUMEL).to(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    started = time.perf_counter()
    dist.all_reduce(tensor)
    correct = torch.equal(tensor.cpu(), reduce_expected(ctx.world_size, REDUCE_NUMEL))  # .cpu() waits
    return correct, time.perf_counter() - started


def _pairs(leaders: dict[int, int], world_size: int) -> list[tuple[int, int, int, int]]:
    """(node a, node b, rank a, rank b) for each pair of node leaders; one node: its ranks 0 and 1."""
    nodes = sorted(leaders)
    if len(nodes) > 1:
        return [(a, b, leaders[a], leaders[b]) for i, a in enumerate(nodes) for b in nodes[i + 1 :]]
    return [(nodes[0], nodes[0], 0, 1)] if world_size > 1 else []


def measure_bandwidth(
    ctx: DistContext, leaders: dict[int, int], nbytes: int, reps: int
) -> list[tuple[int, int, float]]:
    """Ping-pong between each pair in turn (the others wait): GB/s = bytes moved / time, both directions."""
    payload, received = (torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=ctx.device) for _ in range(2))
    links = []
    for node_a, node_b, rank_a, rank_b in _pairs(leaders, ctx.world_size):
        if ctx.rank not in (rank_a, rank_b):
            continue
        peer = rank_b if ctx.rank == rank_a else rank_a
        elapsed = 0.0
        for rep in range(reps + 1):  # the first: warm-up (connection set-up, NCCL's pair communicator)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            started = time.perf_counter()
            if ctx.rank == rank_a:
                dist.send(payload, dst=peer)
                dist.recv(received, src=peer)
            else:
                dist.recv(received, src=peer)
                dist.send(payload, dst=peer)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            if rep:
                elapsed += time.perf_counter() - started
        if ctx.rank == rank_a:
            links.append((node_a, node_b, 2 * reps * payload.numel() * 4 / max(elapsed, 1e-9) / 1e9))
    return links
