"""One run object that owns every rule of a training run, so that an experiment is its training logic.

An experiment writes its model, data, an explicit loop and its evaluation; the run carries the rest, each rule
in one place. Its phases are types: ``TrainingRun.plan`` returns the ``Plan``, whose ``resume_or_start`` returns
the ``TrainingLoop`` the experiment drives (the pattern: ddp_core/templates/experiment.py.template, whose steps
docs/new-experiment.md explains).

The run's rules are components in ``ddp_core/lifecycle/`` (docs/design.md has the picture): the checkpointer,
the metrics log and the stop policy own their cadence; the loop's ``step`` is the coordinator that calls them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ddp_core import observers
from ddp_core.config import CommonArgs, check_values, require
from ddp_core.distributed import flight_recorder
from ddp_core.distributed.env import healing
from ddp_core.distributed.group import DistContext, process_group, wrap_ddp
from ddp_core.errors import AgreedConfigError, alike_on_the_node
from ddp_core.lifecycle.checkpointer import Trained
from ddp_core.lifecycle.heal import Healer
from ddp_core.lifecycle.loop import LoopArgs, TrainingLoop
from ddp_core.lifecycle.parts import build_parts
from ddp_core.lifecycle.plan import Evaluate, Plan, StepsArgs, make_plan
from ddp_core.lifecycle.states import Kind, NamedStates
from ddp_core.output.checkpoint import CheckpointFileArgs
from ddp_core.output.logging import setup_logging
from ddp_core.output.resume import answered_finished, resumed_args
from ddp_core.output.run import RunDir, start_run
from ddp_core.output.source import file_of
from ddp_core.process import heartbeat
from ddp_core.process.entry import EntryMain, entry_main
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.comm import CommArgs, CommHook, ddp_knobs_set, shard_optimizer
from ddp_core.training.seed import enable_determinism, loader_generator, seed_everything, speed_switches

log = logging.getLogger(__name__)
__all__ = ["StepsArgs", "TrainingArgs", "TrainingRun", "experiment_main"]


@dataclass
class TrainingArgs(LoopArgs, CommArgs, CheckpointFileArgs, CommonArgs):
    """The options every training experiment shares, each declared beside the part that owns it: ``CommonArgs``
    (the run directory, the seed, the process group), the checkpoint files' (``output/checkpoint.py``), DDP's
    communication knobs (``training/comm.py``), and the loop's with its components' cadences (``lifecycle/``).
    An experiment's ``Args`` subclasses it (and ``StepsArgs`` for a length in optimizer steps); redeclaring a
    shared option with a plain value (``log_every: int = 20``) gives it the experiment's own default."""


A = TypeVar("A", bound=TrainingArgs)  # a training experiment's options


class TrainingRun:
    """Entered once per training process (``experiment_main`` does): process group, stop signals, logging,
    determinism, run directory; the experiment's ``train(run, args)`` gets it entered (the module docstring)."""

    def __init__(self, name: str, args: TrainingArgs, headline: tuple[str, ...] = (), code: Path | None = None) -> None:
        self.name, self.args = name, args
        self.headline = headline  # the experiment's headline metrics, recorded in manifest.json
        self.code = code  # the experiment's source file, kept in the run directory
        self.loop: TrainingLoop | None = None  # once started: the loop the experiment drives
        self.comm = CommHook(args.comm_hook, args.powersgd_rank, args.powersgd_start_step)
        self.tracked = NamedStates()  # the experiment's own parts with state (``track``)
        self.heal: Healer | None = None  # --heal: the quorum, the commit, a replacement's state (lifecycle/heal.py)

    def __enter__(self) -> TrainingRun:
        with contextlib.ExitStack() as stack:  # a failure in here closes what was opened, in reverse order
            self.ctx: DistContext = stack.enter_context(process_group(self.args.dist_config()))
            observers.mark("group")
            self.signals = stack.enter_context(GracefulStop())
            setup_logging()
            if self.args.deterministic:
                enable_determinism()
            speed_switches(self.ctx.device, self.args.deterministic)
            # made once every value is checked (build_parts): a refused command writes nothing
            self.run_dir: RunDir = start_run(
                self.name, self.args, self.ctx, resume=self.args.resume, headline=self.headline, create=False
            )
            self.run_dir.code_file = self.code  # kept in the run directory with the manifest
            heartbeat.started(self.dir)  # every rank: where its launcher finds the checkpoint to resume from
            flight_recorder.dump_to(self.dir)  # a timed-out collective's record lands next to the run's other files
            seed_everything(self.args.seed)  # the same initial weights on every rank
            self.heal = Healer(self.ctx, self.args.seed, self.args.dist_timeout_s) if healing() else None
            if self.heal is not None:
                stack.callback(self.heal.close)
            self._opened = stack.pop_all()
        return self

    def __exit__(self, *exc_info: Any) -> bool | None:
        self.loop = None  # the model and optimizer go before the process group does
        return self._opened.__exit__(*exc_info)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def dir(self) -> Path:
        return self.run_dir.dir

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model on this rank's device, in DDP, with DDP's knobs as the flags set them (bucket size, static
        graph, gradients as bucket views, a communication hook: ddp_core/training/comm.py).

        A world of one trains the model itself, as Lightning and Accelerate do for one process: DDP would all-reduce
        each gradient with no other rank, and its hooks cost 11% of an eager ResNet-18 step on one GPU
        (docs/benchmarks.md). A DDP knob set away from its default keeps DDP, since it was asked for."""
        args = self.args
        if self.heal is not None:
            views = args.gradient_as_bucket_view
            return self.heal.wrap(
                model.to(self.ctx.device), bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=views
            )
        if self.ctx.world_size == 1 and not ddp_knobs_set(args):
            return model.to(self.ctx.device)
        options = dict(bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph)
        wrapped = wrap_ddp(model, self.ctx, gradient_as_bucket_view=args.gradient_as_bucket_view, **options)
        self.comm.register(wrapped)
        return wrapped

    def track(self, name: str, obj: Any, *, per_rank: bool = False) -> Any:
        """Save and restore ``obj`` (anything with ``state_dict()`` and ``load_state_dict(state)``, in tensors and
        plain types) with the run's checkpoints, as ``checkpoint[name]``; call it before the run starts
        (``plan.resume_or_start``), which loads it on a resume. Replicated by default: the same on every rank, rank
        0's saved, compared across the ranks with the model (``--check-replicas-every``); ``per_rank``: each rank's
        own, which starts afresh at another world size (docs/decisions.md). Returns ``obj``."""
        if self.loop is not None:
            raise AgreedConfigError(f"run.track({name!r}, ...) after the run started: track it before resume_or_start")
        self.tracked.add(name, obj, Kind.PER_RANK if per_rank else Kind.REPLICATED, tracked=True)
        return obj

    def loader_generator(self) -> torch.Generator:
        """A DataLoader's own generator: creating its iterator then leaves the global RNG as it was."""
        return loader_generator(self.args.seed, self.ctx.rank)

    # ------------------------------------------------------------------------------------ the phases

    def plan(
        self,
        loader: Any = None,
        *,
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        batch_size: int | None = None,
        per_epoch: bool = False,
        evaluate: Evaluate | None = None,
        unit: str = "samples",
    ) -> Plan[TrainingLoop]:
        """The run's shape: ``total_steps`` optimizer steps, or ``epochs`` epochs. ``loader`` (a DataLoader, or
        anything with ``len`` and ``batch_size``) gives the epoch's length in optimizer steps and the batch per
        process, unless ``steps_per_epoch`` or ``batch_size`` say otherwise. Without a loader or ``steps_per_epoch``:
        a run counted in steps alone (a stream of batches, no epochs: loop over ``loop.steps(stream)`` without
        ``loop.epochs()``). ``evaluate(step, writer)`` (the step it follows, TensorBoard's writer for what else it
        logs) returns the evaluation's metrics, a dict or a result with ``as_metrics()`` (kept as
        ``loop.last_evaluation``; logged as ``eval/NAME``, and as ``eval_NAME`` in metrics.json).
        ``per_epoch``: evaluate and checkpoint at each epoch's end. How often the run logs, evaluates and
        checkpoints is the user's: --log-every, --eval-every, --checkpoint-every. Then ``plan.resume_or_start``."""
        return make_plan(
            loader,
            total_steps=total_steps,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            batch_size=batch_size,
            world_size=self.world_size,
            grad_accum=self.args.grad_accum,
            per_epoch=per_epoch,
            evaluate=evaluate,
            unit=unit,
            stop_at_step=self.args.stop_at_step,
            eval_every=self.args.eval_every,
            start=self._start,
            profile=self.args.profile,
        )

    def _start(
        self,
        plan: Plan[TrainingLoop],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
    ) -> TrainingLoop:
        """``Plan.resume_or_start``: the loop, resumed from a checkpoint or started; once per run."""
        if self.loop is not None:
            raise RuntimeError("a run starts once: call plan.resume_or_start(model, optimizer) a single time")
        if self.args.zero:
            optimizer = shard_optimizer(optimizer)
        trained = Trained(model, optimizer, scaler, self.comm)
        parts = build_parts(self, plan, trained)  # a resume puts the checkpoint back here
        self.loop = TrainingLoop(plan, parts, self.ctx, trained, collective_timeout_s=self.args.dist_timeout_s)
        return self.loop


def check_training_args(args: TrainingArgs, validate: Callable[[Any], None] | None = None) -> None:
    """Everything checked before any process starts (a ConfigError, exit 2): the declared ranges again, for arguments
    changed in code, --stop-at-step against --steps, DDP's static graph against accumulation, and the experiment's
    own ``validate``."""
    check_values(args)
    args.check_resume_from()
    if isinstance(args, StepsArgs):  # a length in epochs is checked by plan(), once the loader is known
        require(
            args.stop_at_step <= args.steps,
            f"--stop-at-step={args.stop_at_step} is beyond --steps={args.steps}: it must be at most --steps (0: "
            "train to the end)",
        )
    require(
        not (args.static_graph and args.grad_accum > 1),
        f"--static-graph with --grad-accum={args.grad_accum}: DDP's static graph breaks on the backward passes "
        "that skip the all-reduce (torch's reducer asserts, pytorch/pytorch#143580): drop --static-graph, or "
        "use --grad-accum 1",
    )
    held = [flag for flag, on in (("--comm-hook", args.comm_hook != "none"), ("--zero", args.zero)) if on]
    require(
        not (healing() and (held or args.static_graph)),
        f"--heal cannot carry {', '.join(held) or '--static-graph'}: torchft's DDP averages every gradient itself "
        "and a replacement receives the whole optimizer from a peer: drop it, or --heal",
    )
    if validate is not None:
        validate(args)


@dataclass(frozen=True)
class Training:
    """An experiment's work in each process: ``prepare(args)`` before the process group (a download), then
    ``train(run, args[, prepared])`` inside a ``TrainingRun``."""

    name: str
    train: Callable[..., dict[str, Any]]
    prepare: Callable[[Any], Any] | None = None
    headline: tuple[str, ...] = ()

    def __call__(self, args: TrainingArgs) -> dict[str, Any]:
        with alike_on_the_node():  # the node's files (a download, the data): every process there finds the same
            prepared = self.prepare(args) if self.prepare is not None else None  # before the group: no timeout runs
        with TrainingRun(self.name, args, self.headline, code=file_of(self.train)) as run:
            metrics = self.train(run, args) if self.prepare is None else self.train(run, args, prepared)
        run.signals.exit_if_stopped()  # a signal stopped it: exit 143, after the group is closed
        return metrics


def experiment_main(
    name: str,
    args_type: type[A],
    train: Callable[..., dict[str, Any]],
    *,
    doc: str | None,
    validate: Callable[[A], None] | None = None,
    prepare: Callable[[A], Any] | None = None,
    headline: Sequence[str] = (),
) -> EntryMain[A, dict[str, Any]]:
    """The entry point of the experiment ``name``: flags parsed into ``args_type`` (a resume: the checkpoint's
    options but those set, output/resume.py; a finished run answered) and checked (``validate``, before any
    process starts), ``prepare(args)`` run before the process group (a download), then
    ``train(run, args[, prepared])`` inside a ``TrainingRun``, under torchrun, as a world of one or --nproc.
    ``headline``: the metrics of metrics.json that say how the run did, first the one that matters most (recorded
    in manifest.json: the runs table shows them first, and a study compares the first by default)."""
    check = functools.partial(check_training_args, validate=validate)
    declared = (headline,) if isinstance(headline, str) else tuple(headline)
    training = Training(name, train, prepare, declared)
    resolve = functools.partial(resumed_args, name)  # a resume: the checkpoint's options, but those set
    return entry_main(args_type, training, doc=doc or name, validate=check, answer=answered_finished, resolve=resolve)
