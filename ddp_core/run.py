"""The run directory: where rank 0, and only rank 0, writes manifest.json, metrics.json, TensorBoard and checkpoints."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ddp_core.checkpoint import atomic_write
from ddp_core.collectives import all_gather_object, broadcast_object
from ddp_core.dist import DistContext
from ddp_core.errors import ConfigError
from ddp_core.logging import RankZeroWriter

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_NAME = "checkpoints/last.pt"


@dataclass
class Run:
    dir: Path
    ctx: DistContext
    resume: bool
    started: datetime

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / CHECKPOINT_NAME

    def open_writer(self, purge_step: int | None = None) -> RankZeroWriter:
        """TensorBoard writer in the run directory; on resume, events past ``purge_step`` are discarded."""
        return RankZeroWriter(self.dir, enabled=self.ctx.is_main, purge_step=purge_step)

    def finish(self, metrics: dict[str, Any]) -> None:
        """Write metrics.json (rank 0) with the wall time since the run started."""
        metrics = {**metrics, "wall_time_s": (datetime.now(timezone.utc) - self.started).total_seconds()}
        if self.ctx.is_main:
            write_json_atomic(self.dir / "metrics.json", metrics)


def write_json_atomic(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    atomic_write(path, lambda handle: handle.write(text.encode()))


def _git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain").strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}  # not a git checkout (e.g. inside the Docker image)


def _versions() -> dict[str, Any]:
    def package(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)  # without importing it: torchvision is slow to import
        except importlib.metadata.PackageNotFoundError:
            return None

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": package("torchvision"),
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def _run_of_this_job(experiment: str, run_id: str) -> Path | None:
    """The run directory an earlier attempt of this torchrun job created (same TORCHELASTIC_RUN_ID)."""
    for manifest in sorted(Path("runs", experiment).glob("*/manifest.json"), reverse=True):
        try:
            if json.loads(manifest.read_text()).get("torchelastic_run_id") == run_id:
                return manifest.parent
        except (OSError, ValueError):
            continue
    return None


def _choose_dir(experiment: str, requested: str, resume: bool, restarted: bool, earlier: Path | None) -> tuple[Path, bool]:
    """The run directory, and whether to resume from its checkpoint.

    A worker restarted by ``torchrun --max-restarts`` (attempt > 1: a restart, or a new c10d round)
    continues the run its first attempt started (``earlier``), from its last checkpoint: that is what
    restarting is for.
    """
    if requested:
        run_dir = Path(requested)
    elif earlier is not None:
        run_dir = earlier
    elif resume:
        raise ConfigError("--resume needs --run-dir (or RUN_DIR) naming the run to continue")
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        run_dir = Path("runs") / experiment / stamp
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = Path("runs") / experiment / f"{stamp}-{suffix}"
    checkpoint = run_dir / CHECKPOINT_NAME
    if restarted and checkpoint.is_file():
        return run_dir, True
    if resume and not checkpoint.is_file():
        raise ConfigError(f"--resume: no checkpoint at {checkpoint}: start without --resume, or point --run-dir at the run to continue")
    if not resume and not restarted and checkpoint.exists():
        raise ConfigError(f"{run_dir} already holds a checkpoint: pass --resume to continue that run, or choose another --run-dir")
    return run_dir, resume


def _refuse_a_checkpoint_on_another_host(seen: list[tuple[str, str | None]]) -> None:
    """Rank 0 has no checkpoint to continue from, but another host has one: never start over silently.

    Under c10d rendezvous the node ranks of a restarted job can change, so rank 0 (the only rank that
    reads and writes the run directory) may now be on a host whose runs/ never saw this run.
    """
    for rank, (host, checkpoint) in enumerate(seen):
        if checkpoint is not None and host != seen[0][0]:
            raise ConfigError(
                f"rank 0 (host {seen[0][0]}) has no checkpoint of this run, but rank {rank} (host {host}) has {checkpoint}: "
                "the restart moved rank 0 to another node; keep runs/ on storage every node shares (RUNS_VOLUME), "
                "or use static rendezvous (fixed node ranks)"
            )


def start_run(experiment: str, args: Any, ctx: DistContext, resume: bool = False) -> Run:
    """Agree on the run directory (and whether it resumes) on every rank; write manifest.json on rank 0.

    Every rank calls it. ``run.resume`` is the decision to act on: it is also true for a worker that
    torchrun restarted after a failure, when the run has a checkpoint.
    """
    run_id, restarted = os.environ.get("TORCHELASTIC_RUN_ID"), ctx.attempt > 1
    earlier = _run_of_this_job(experiment, run_id) if restarted and run_id and not args.run_dir else None
    candidate = Path(args.run_dir) if args.run_dir else earlier  # what a --resume or a restart continues
    checkpoint_here = candidate / CHECKPOINT_NAME if candidate is not None and (resume or restarted) else None
    seen = all_gather_object((socket.gethostname(), str(checkpoint_here) if checkpoint_here and checkpoint_here.is_file() else None))
    decision: tuple[str, Any] = ("ok", None)
    if ctx.is_main:
        try:
            if (resume or restarted) and seen[0][1] is None:
                _refuse_a_checkpoint_on_another_host(seen)
            run_dir, resuming = _choose_dir(experiment, args.run_dir, resume, restarted, earlier)
            decision = ("ok", (str(run_dir), resuming))
        except ConfigError as error:
            decision = ("error", str(error))
    status, value = broadcast_object(decision)  # all ranks fail together, or none does
    if status == "error":
        raise ConfigError(value)
    run = Run(dir=Path(value[0]), ctx=ctx, resume=value[1], started=datetime.now(timezone.utc))
    hosts = [host for host, _ in seen]
    if ctx.is_main:
        (run.dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        _write_manifest(run, experiment, args, hosts)
        if run.resume and ctx.device.type == "cuda" and not getattr(args, "deterministic", False):
            log.warning("resuming on CUDA without --deterministic: some GPU kernels are non-deterministic, so this run will "
                        "match an uninterrupted one statistically, not bitwise (pass --deterministic for bitwise)")
    return run


def _write_manifest(run: Run, experiment: str, args: Any, hosts: list[str]) -> None:
    env = run.ctx.env
    manifest: dict[str, Any] = {
        "experiment": experiment,
        "config": dataclasses.asdict(args),
        "seed": args.seed,
        "world": {
            "world_size": env.world_size,
            "nodes": env.num_nodes,
            "processes_per_node": env.local_world_size,
            "backend": run.ctx.backend,
            "device": run.ctx.device.type,
            "restart_count": env.restart_count,
            "attempt": run.ctx.attempt,
        },
        "git": _git_state(),
        "versions": _versions(),
        "hosts": sorted(set(hosts)),
        "command": sys.argv,
        "start_time": run.started.isoformat(),
        "resumed": run.resume,
        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
    }
    path = run.dir / "manifest.json"
    if path.exists():  # a resumed run keeps what every earlier launch recorded
        previous = json.loads(path.read_text())
        manifest["history"] = previous.pop("history", []) + [previous]
    write_json_atomic(path, manifest)
