"""The loop's parts, built before it: ``plan.resume_or_start`` builds them here and hands them to the
``TrainingLoop`` (``loop.py``) in one ``Parts``.

A resume happens here: the checkpointer puts the checkpoint's states back by name (or each rank's random streams
start afresh), then the metrics log opens its writer at the step the run continues from, and the profiler's
window is judged against it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ddp_core import observers
from ddp_core.config import own
from ddp_core.distributed.agreement import rank0_decides
from ddp_core.distributed.env import joining
from ddp_core.distributed.group import DistContext
from ddp_core.layout import METRICS, PROFILE, memory_snapshot_name, profile_trace_name
from ddp_core.lifecycle.checkpointer import Checkpointer, CheckpointerArgs, Recorded, Trained
from ddp_core.lifecycle.heal import Healer
from ddp_core.lifecycle.late_reads import LateReads, reads_late
from ddp_core.lifecycle.metrics_log import MetricsLog, MetricsLogArgs
from ddp_core.lifecycle.plan import Plan
from ddp_core.lifecycle.position import Position
from ddp_core.lifecycle.rank_times import RankTimes
from ddp_core.lifecycle.states import Kind, NamedStates
from ddp_core.lifecycle.stop_policy import StopPolicy, StopPolicyArgs
from ddp_core.output.resume import AlreadyFinished
from ddp_core.output.run import RunDir
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.buckets import FirstStepReplay
from ddp_core.training.comm import CommHook
from ddp_core.training.profiling import StepProfiler
from ddp_core.training.seed import seed_rank_streams
from ddp_core.training.step_time import StepTimer


class Run(Protocol):
    """What the parts are built from: the run (``TrainingRun``) once entered."""

    name: str  # the experiment's
    args: Any  # its options: the loop's (``LoopArgs``), the seed, --allow-config-change
    ctx: DistContext
    run_dir: RunDir
    signals: GracefulStop
    comm: CommHook
    tracked: NamedStates  # the experiment's own states (``run.track``)
    heal: Healer | None  # --heal's quorum and commit


@dataclass(frozen=True)
class Parts:
    """The run's components, each owning its rule (docs/design.md), as the loop coordinates them."""

    position: Position
    checkpointer: Checkpointer
    stops: StopPolicy
    metrics: MetricsLog
    timer: StepTimer  # compute and comm wait per step
    profiler: StepProfiler  # --profile's window
    late: LateReads | None  # log points read late (--log-reads)
    replay: FirstStepReplay | None  # a resume's first step, run once more and undone (training/buckets.py)
    heal: Healer | None  # --heal's quorum and commit (heal.py)


def build_parts(run: Run, plan: Plan[Any], trained: Trained) -> Parts:
    """Every part, the checkpoint's states put back on a resume (a collective)."""
    args, ctx, run_dir = run.args, run.ctx, run.run_dir
    position = Position(plan.steps_per_epoch, plan.samples_per_step)
    recorded = Recorded(run.name, asdict(args), args.seed, args.allow_config_change)
    options = own(CheckpointerArgs, args)
    checkpointer = Checkpointer(run_dir, recorded, options, trained, position, run.tracked, per_epoch=plan.per_epoch)
    stops = StopPolicy(run.signals, own(StopPolicyArgs, args), trained.model, ctx.device)
    for named in checkpointer.states.of(Kind.REPLICATED):
        if named.tracked:  # the same on every rank, as the model: compared with it
            stops.replicas.track(named.name, named.part)
    observer = observers.current()  # an instrument's (bench, the contract): none by default
    if observer is not None:
        observer.run_started(run_dir.dir, ctx.rank)
    metrics: MetricsLog | None = None  # opened at the step the run continues from

    def settled() -> None:  # DDP's buckets are settled: the time before was set-up, not training
        assert metrics is not None
        metrics.restart_clocks()

    replay, heal, joined = None, run.heal, joining()
    if heal is not None and joined:  # --heal's replacement: the state from a live peer (heal.py)
        heal.attach(checkpointer, position.step)
        heal.join()
        stops.resumed_at(position.step)
    if run_dir.resume and not (heal is not None and heal.received):  # the checkpoint's state (no peer alive)
        observers.mark("loading")  # bench.recovery: set-up is done, the checkpoint is read next
        replay = checkpointer.resume(ctx.world_size, ctx.rank, on_undo=settled)
        observers.mark("loaded", step=position.step)
        stops.resumed_at(position.step)
        if position.step >= plan.total_steps and rank0_decides((run_dir.dir / METRICS).is_file):
            raise AlreadyFinished(run_dir.dir)  # changed, but no longer (--allow-config-change): no file is written
    elif not joined:
        seed_rank_streams(args.seed, ctx.rank)  # from here on, random draws differ per rank
    if heal is not None:
        heal.attach(checkpointer, position.step)
        replay = None
    if not joined:
        run_dir.create()  # every value is checked (a resume's states too): now the run directory and its manifest
    timer = StepTimer(trained.model, ctx.device, on_synced_pass=trained.comm.count_pass)
    ranks = RankTimes(timer, trained.comm, run_dir.hosts)
    resumed_at = position.step if run_dir.resume or joined else None
    metrics = MetricsLog(run_dir, own(MetricsLogArgs, args), plan, ctx.device, resumed_at, ranks, recorded.config)
    checkpointer.add("metrics", metrics)
    if heal is not None:
        heal.attach_metrics(metrics)
    folder = run_dir.dir / PROFILE  # each rank writes its own files
    trace, memory = folder / profile_trace_name(ctx.rank), folder / memory_snapshot_name(ctx.rank)
    profiler = StepProfiler(args.profile, position.step, ctx.device, ctx.rank, trace, memory, metrics)
    late = LateReads() if reads_late(args.log_reads, ctx.device) else None
    return Parts(position, checkpointer, stops, metrics, timer, profiler, late, replay, heal)
