"""The run directory: where rank 0, and only rank 0, writes manifest.json, metrics.json, TensorBoard and checkpoints."""

from __future__ import annotations

import dataclasses
import functools
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
from typing import Any, Callable

import torch

from ddp_core.config import CommonArgs, config_changes, directory_problem
from ddp_core.distributed import cuda
from ddp_core.distributed.agreement import rank0_decides
from ddp_core.distributed.collectives import all_gather_object
from ddp_core.distributed.env import joining, nnodes_range
from ddp_core.distributed.group import DistContext
from ddp_core.errors import ConfigError
from ddp_core.layout import CHECKPOINTS, KEEP, MANIFEST, METRICS, STAMP
from ddp_core.output import process_identity
from ddp_core.output.checkpoint import (
    THREAD,
    CheckpointDir,
    CheckpointFileArgs,
    Written,
    atomic_write,
    check_world_size,
    checkpoint_writer,
    written_by,
)
from ddp_core.output.logging import RankZeroWriter
from ddp_core.output.source import file_of, keep_code
from ddp_core.output.storage import StorageError, describe, is_storage_error
from ddp_core.ranks import on_rank0

log = logging.getLogger(__name__)
WORLD_SIZE_CHANGE = "world size: "  # config_changes' entry for another world size: "world size: 2 -> 1"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunDir:
    """A run's directory as every rank agreed on it (``start_run``); global rank 0 alone writes into it."""

    dir: Path
    ctx: DistContext
    resume: bool
    started: datetime
    keep_checkpoints: int = KEEP
    background_checkpoints: bool = False  # --checkpoint-async
    checkpoint_writer: str = THREAD  # --checkpoint-writer, resolved for this rank's device
    resume_from: Path | None = None  # --resume-from: exactly this file, instead of the newest checkpoint
    config_changes: list[str] = dataclasses.field(default_factory=list)  # --allow-config-change: what differs
    writers: list[RankZeroWriter] = dataclasses.field(default_factory=list, repr=False)
    hosts: list[str] = dataclasses.field(default_factory=list)  # every rank's host, by rank
    code_file: Path | None = None  # the experiment's source file, copied as the directory is made; else __main__'s
    _make: Callable[[], None] | None = dataclasses.field(default=None, repr=False)  # until create() has run

    def create(self) -> None:
        """Collective, once: rank 0 makes the directory and writes manifest.json. A training run calls it when
        every value is checked (``start_run(..., create=False)``): a refused command leaves nothing behind. A
        directory rank 0 cannot write stops every rank here, not at the first checkpoint."""
        make, self._make = self._make, None
        if make is not None:
            rank0_decides(lambda: self._write_or_stop(self.dir / MANIFEST, make))
            on_rank0(lambda: _started_here.append(self))

    @property
    def checkpoint_path(self) -> Path:
        """``checkpoints/last.pt``: always the newest complete checkpoint."""
        return self.checkpoints.last

    @property
    def checkpoints(self) -> CheckpointDir:
        return CheckpointDir.of_run(
            self.dir, keep=self.keep_checkpoints, background=self.background_checkpoints, writer=self.checkpoint_writer
        )

    def save_checkpoint(
        self, step: int, states: Callable[[], dict[str, Any]], about: dict[str, Any] | None = None
    ) -> Path:
        """Collective: ``CheckpointDir.save``; a TensorBoard write that failed since the last save stops every rank
        here too."""
        return self.checkpoints.save(step, states, about, self._writer_failure)

    def load_checkpoint(self) -> tuple[dict[str, Any], Path]:
        """Collective: the checkpoint to resume from (--resume-from's file, else the newest that loads) and its path."""
        return self.checkpoints.load_for_resume(self.resume_from)

    def _writer_failure(self) -> tuple[str, OSError] | None:
        for writer in self.writers:
            failure = writer.poll()
            if failure is not None:
                return failure
        return None

    def open_writer(self, purge_step: int | None = None) -> RankZeroWriter:
        """TensorBoard writer in the run directory (events past ``purge_step`` discarded); every rank must ``close()``
        it: a write that failed on rank 0 stops every rank there."""
        writer = RankZeroWriter(
            self.dir, purge_step=purge_step, collective=True, intact=lambda: self.checkpoints.intact()
        )
        self.writers.append(writer)
        return writer

    def finish(self, metrics: dict[str, Any]) -> None:
        """Collective: rank 0 writes metrics.json with the wall time since the run started."""
        self.checkpoints.wait()  # the run's last checkpoint on disk before metrics.json says the run ended
        metrics = {**metrics, "wall_time_s": (datetime.now(timezone.utc) - self.started).total_seconds()}
        path = self.dir / METRICS
        rank0_decides(lambda: self._write_or_stop(path, lambda: write_json_atomic(path, metrics)))

    def _write_or_stop(self, path: Path, write: Callable[[], None]) -> None:
        """Rank 0's write of ``path``; a full disk or a refused folder becomes the StorageError every rank raises."""
        try:
            write()
        except OSError as error:
            if not is_storage_error(error):
                raise
            # the run directory itself could not be made: name what refused it
            where = path if self.checkpoints.dir.is_dir() else Path(error.filename or self.dir)
            raise StorageError(describe(where, error, self.checkpoints.intact())) from None


@dataclass(frozen=True)
class _Choice:
    """What rank 0 decided for every rank: the run directory, whether it resumes, from which file, what changed."""

    dir: str
    resume: bool
    resume_from: str  # --resume-from's file, "" for the newest checkpoint
    changes: list[str]


_started_here: list[RunDir] = []  # rank 0's runs in this process: record_exit writes their outcome


def record_exit(code: int) -> None:
    """Rank 0, as the process leaves: each run started here records its exit code in manifest.json (for
    ``ddp_core.runs``), after closing its TensorBoard writers on this rank only (the others may be gone). Never
    raises: a manifest that cannot be rewritten is left as it is."""
    while _started_here:
        run = _started_here.pop()
        for writer in run.writers:
            writer.close_here()
        path = run.dir / MANIFEST
        try:
            manifest = json.loads(path.read_text())
            manifest.update(exit_code=code, end_time=datetime.now(timezone.utc).isoformat())
            write_json_atomic(path, manifest)
        except (OSError, ValueError) as error:
            log.warning("could not record exit code %d in %s: %s", code, path, error)


def write_json_atomic(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    atomic_write(path, lambda handle: handle.write(text.encode()))


def _git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout

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

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": package("torchvision"),
        "cuda": torch.version.cuda,  # the CUDA torch was built for (set on CPU too: it names the wheel)
        "driver": cuda.driver_version(),  # rank 0's host; None without an NVIDIA driver
        **cuda.library_versions(),  # cudnn, nccl: None without CUDA
    }


def _run_of_this_job(experiment: str, run_id: str) -> Path | None:
    """The run directory an earlier attempt of this torchrun job created (same TORCHELASTIC_RUN_ID)."""
    for manifest in sorted(Path("runs", experiment).glob(f"*/{MANIFEST}"), reverse=True):
        try:
            if json.loads(manifest.read_text()).get("torchelastic_run_id") == run_id:
                return manifest.parent
        except (OSError, ValueError):
            continue
    return None


def _run_dir_of(checkpoint: Path) -> Path:
    """The run a --resume-from file belongs to: RUN/checkpoints/FILE."""
    if checkpoint.parent.name != CHECKPOINTS:
        raise ConfigError(
            f"--resume-from={checkpoint} is not in a run's checkpoints/ folder: pass --run-dir too, naming the run to "
            "write"
        )
    return checkpoint.parent.parent


def _choose_dir(
    experiment: str, requested: str, resume: bool, restarted: bool, earlier: Path | None, resume_from: str = ""
) -> tuple[Path, bool]:
    """The run directory, and whether to resume from its checkpoint. A restarted worker continues the run its first
    attempt started (``earlier``); ``resume_from`` implies ``resume``."""
    resume = resume or bool(resume_from)
    if requested:
        run_dir = Path(requested)
    elif earlier is not None:
        run_dir = earlier
    elif resume_from:
        run_dir = _run_dir_of(Path(resume_from))
    elif resume:
        raise ConfigError("--resume needs --run-dir (or RUN_DIR) naming the run to continue")
    else:
        stamp = datetime.now(timezone.utc).strftime(STAMP)
        run_dir = Path("runs") / experiment / stamp
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = Path("runs") / experiment / f"{stamp}-{suffix}"
    problem = directory_problem(run_dir, writable=True)  # parse_args checked --run-dir; this is also the default
    if problem:
        raise ConfigError(
            f"run directory {run_dir} {problem}: choose a directory rank 0 can create or write into (--run-dir or "
            "RUN_DIR)"
        )
    checkpoint = CheckpointDir.of_run(run_dir).last
    has_checkpoint = CheckpointDir.of_run(run_dir).exists()  # last.pt or a step file (a save killed before last.pt)
    if restarted and has_checkpoint:
        return run_dir, True
    if resume and not has_checkpoint and not resume_from:
        raise ConfigError(
            f"--resume: no checkpoint at {checkpoint}: start without --resume, or point --run-dir at the run to "
            "continue"
        )
    if not resume and not restarted and (has_checkpoint or checkpoint.exists()):
        raise ConfigError(
            f"{run_dir} already holds a checkpoint: pass --resume to continue that run, or choose another --run-dir"
        )
    return run_dir, resume


def world_size_change(written: Written, world_size: int, allowed: bool, elastic: str | None) -> list[str]:
    """``["world size: OLD -> NEW"]`` where the world differs and that is allowed (--allow-config-change, or an
    elastic node range "MIN:MAX"); [] for the same world; the refusal otherwise."""
    if written.world_size == world_size:
        return []
    if not (allowed or elastic):
        check_world_size(written.world_size, world_size)
    return [f"{WORLD_SIZE_CHANGE}{written.world_size} -> {world_size}"]


def check_same_run(
    written: Written, path: Path, experiment: str, args: CheckpointFileArgs, world_size: int, elastic: str | None = None
) -> list[str]:
    """A resume continues the run the checkpoint holds, or says why not (another experiment, option or world size);
    under --allow-config-change the changes are returned, to log and record."""
    if written.experiment is not None and written.experiment != experiment:
        raise ConfigError(
            f"{path} was written by experiment {written.experiment}, not {experiment}: "
            f"resume it with python -m experiments.{written.experiment}, or choose another --run-dir"
        )
    allowed = args.allow_config_change
    world = world_size_change(written, world_size, allowed, elastic)
    changes = config_changes(written.config or {}, args)
    if changes and not allowed:
        raise ConfigError(
            f"--resume: {', '.join(changes)} (checkpoint -> now, {path.name}): leave them out to continue with the "
            "checkpoint's values, or pass --allow-config-change to continue it with these"
        )
    return changes + world


def _refuse_what_rank0_cannot_continue(per_rank: list[tuple[Any, ...]], args: CommonArgs, continuing: bool) -> None:
    """Rank 0 continues what it holds: never starting over while another host holds a checkpoint (c10d moved rank 0
    to another node), and every rank with rank 0's options (a resume rebuilt them from the run directory, which a
    node without shared storage lacks: it has its command line's)."""
    host0, checkpoint0 = per_rank[0][:2]
    for rank, (host, checkpoint, _, _, theirs) in enumerate(per_rank):
        if continuing and checkpoint0 is None and checkpoint is not None and host != host0:
            raise ConfigError(
                f"rank 0 (host {host0}) has no checkpoint of this run, but rank {rank} (host {host}) has {checkpoint}: "
                "the restart moved rank 0 to another node; keep runs/ on storage every node shares (RUNS_VOLUME), "
                "or use static rendezvous (fixed node ranks)"
            )
        differ = config_changes(theirs, args) if theirs is not None else []
        if differ:
            raise ConfigError(
                f"--resume: rank {rank} (host {host}) would resume with other options than rank 0: {', '.join(differ)} "
                f"(rank {rank} -> rank 0): a resume takes them from the run directory, which that host does not hold; "
                "keep runs/ on storage every node shares (RUNS_VOLUME), or give these flags on every node"
            )


def start_run(
    experiment: str,
    args: CommonArgs,
    ctx: DistContext,
    resume: bool = False,
    headline: tuple[str, ...] = (),
    create: bool = True,
) -> RunDir:
    """Collective: agree on the run directory and whether it resumes (a restarted worker too); rank 0 writes
    manifest.json (with the experiment's ``headline`` metrics) now, or at ``RunDir.create()`` (``create=False``)."""
    run_id, restarted = os.environ.get("TORCHELASTIC_RUN_ID"), ctx.attempt > 1 or joining()  # --heal's replacement
    elastic = nnodes_range()  # ddp_core.torchrun under c10d with --nnodes=MIN:MAX: the world may change
    # a training experiment's checkpoint options; a tool that trains nothing (commbench) has none
    checkpointing = args if isinstance(args, CheckpointFileArgs) else None
    resume_from = checkpointing.resume_from if checkpointing else ""
    resume = resume or bool(resume_from)
    earlier = _run_of_this_job(experiment, run_id) if restarted and run_id and not args.run_dir else None
    candidate = Path(args.run_dir) if args.run_dir else earlier  # what a --resume or a restart continues
    newest_here = CheckpointDir.of_run(candidate).newest() if candidate is not None and (resume or restarted) else None
    # One collective for everything rank 0 needs from every rank: host, checkpoint found there, device, network,
    # a resume's options (each node rebuilt them from its run directory, or from its command line without one)
    network = ctx.network.as_dict() if ctx.network is not None else None
    here, options = str(newest_here) if newest_here else None, dataclasses.asdict(args) if resume else None
    row = (socket.gethostname(), here, cuda.describe_device(ctx.device), network, options)
    per_rank = [row] * ctx.world_size if joining() else all_gather_object(row)  # a --heal replacement: alone
    hosts, devices, networks = [[each[i] for each in per_rank] for i in (0, 2, 3)]

    def choose() -> _Choice:
        _refuse_what_rank0_cannot_continue(per_rank, args, (resume or restarted) and not resume_from)
        run_dir, resuming = _choose_dir(experiment, args.run_dir, resume, restarted, earlier, resume_from)
        # a restarted worker continues what this run has written since, not the file it first resumed from
        exactly = resume_from if resume_from and not (restarted and CheckpointDir.of_run(run_dir).exists()) else ""
        changes: list[str] = []
        if resuming and checkpointing is not None:  # refused before manifest.json records an attempt that cannot run
            newest = Path(exactly) if exactly else CheckpointDir.of_run(run_dir).newest()
            written = written_by(newest) if newest is not None else None
            if written is not None and not restarted:
                changes = check_same_run(written, newest, experiment, checkpointing, ctx.world_size, elastic)
            elif written is not None:  # the same command again: only the world can differ (a node left or came)
                changes = world_size_change(written, ctx.world_size, checkpointing.allow_config_change, elastic)
        return _Choice(str(run_dir), resuming, exactly, changes)

    choice = rank0_decides(choose)  # all ranks refuse together, or none does
    run = RunDir(
        dir=Path(choice.dir),
        ctx=ctx,
        resume=choice.resume,
        started=datetime.now(timezone.utc),
        resume_from=Path(choice.resume_from) if choice.resume_from else None,
        config_changes=choice.changes,
        hosts=hosts,
        **_checkpoint_settings(checkpointing, ctx.device),
    )

    run._make = functools.partial(_make_run_dir, run, experiment, args, hosts, devices, networks, headline)
    if create:
        run.create()
    return run


def _checkpoint_settings(options: CheckpointFileArgs | None, device: torch.device) -> dict[str, Any]:
    """RunDir's checkpoint fields from a training experiment's options; a tool that trains nothing has none."""
    if options is None:
        return {}
    return dict(
        keep_checkpoints=options.keep_checkpoints,
        background_checkpoints=options.checkpoint_async,
        checkpoint_writer=checkpoint_writer(options.checkpoint_writer, device),
    )


def _warn_about_the_resume(run: RunDir, deterministic: bool, elastic: str | None) -> None:
    """What a resume continues with that an uninterrupted run would not have (logged by rank 0 only)."""
    world_only = all(change.startswith(WORLD_SIZE_CHANGE) for change in run.config_changes)
    if run.config_changes and not (elastic and world_only):  # elastic: the resume's one line says it
        changes = ", ".join(run.config_changes)
        log.warning(
            "--allow-config-change: this run continues %s with %s (recorded in manifest.json)", run.dir, changes
        )
    if run.resume and run.ctx.device.type == "cuda" and not deterministic:
        log.warning(
            "resuming on CUDA without --deterministic: some GPU kernels are non-deterministic, so this run will "
            "match an uninterrupted one statistically, not bitwise (pass --deterministic for bitwise)"
        )


def _gpu_names(devices: list[str]) -> list[str]:
    """The distinct GPU models among the ranks' devices ("cuda:0 NVIDIA H100 80GB HBM3" -> "NVIDIA H100 80GB HBM3")."""
    return sorted({device.split(" ", 1)[1] for device in devices if device.startswith("cuda:") and " " in device})


def _make_run_dir(run: RunDir, experiment: str, args: CommonArgs, *manifest: Any) -> None:
    """The run directory and its manifest.json (rank 0: ``RunDir.create``)."""
    run.checkpoints.dir.mkdir(parents=True, exist_ok=True)
    _write_manifest(run, experiment, args, *manifest)
    _warn_about_the_resume(run, args.deterministic, nnodes_range())  # once it goes on: a finished run does not


def _write_manifest(
    run: RunDir,
    experiment: str,
    args: CommonArgs,
    hosts: list[str],
    devices: list[str],
    networks: list[dict[str, Any] | None],
    headline: tuple[str, ...] = (),
) -> None:
    env = run.ctx.env
    manifest: dict[str, Any] = {
        "experiment": experiment,
        "headline": list(headline),  # the metrics.json keys the experiment reports first (experiment_main)
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
            "nodes_range": nnodes_range(),  # "MIN:MAX" under c10d with --nnodes=MIN:MAX (ddp_core.torchrun), else null
        },
        "git": _git_state(),
        "code": keep_code(run.dir, run.code_file or file_of(None), PROJECT_ROOT),  # its file and git diff, in code/
        "versions": _versions(),
        "hosts": sorted(set(hosts)),
        "devices": devices,  # by global rank: "cuda:0 NVIDIA H100 80GB HBM3" or "cpu"
        "gpus": _gpu_names(devices),  # [] on CPU
        # by global rank: the interface the backend used between nodes, and whether you set it (null on one node)
        "network": networks,
        "command": sys.argv,
        "start_time": run.started.isoformat(),
        "resumed": run.resume,
        "config_changes": run.config_changes,  # --allow-config-change: "--name: old -> new" against the checkpoint
        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "rank0_process": process_identity.this_process(),  # while no "exit_code" is recorded: running, or killed?
    }
    path = run.dir / MANIFEST
    if path.exists():  # a resumed run keeps what every earlier launch recorded
        previous = json.loads(path.read_text())
        manifest["history"] = previous.pop("history", []) + [previous]
    write_json_atomic(path, manifest)
