"""One run object that owns every rule of a training run, so that an experiment is its training logic.

An experiment writes its model, data, an explicit loop and its evaluation; ``TrainingRun`` carries the
rest, each rule in one place::

    def train(run: TrainingRun, args: MyArgs) -> dict[str, float]:
        model = run.wrap(MyModel())                     # the same initial weights on every rank
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        sampler = TrainSampler(len(data), run.rank, run.world_size, seed=args.seed)
        loader = DataLoader(data, args.batch_size, sampler=sampler, drop_last=True, generator=run.loader_generator())
        run.plan(loader, total_steps=args.steps)          # the epoch's length and the batch: the loader's
        run.resume_or_start(model, optimizer)            # a checkpoint's state, or fresh per-rank streams
        for epoch, consumed in run.epochs():             # where a resumed run left off
            sampler.set_epoch(epoch, consumed=consumed)
            for inputs, targets in run.batches(loader):
                loss = loss_fn(model(inputs), targets)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                if run.step(loss):                       # log / evaluate / checkpoint / stop, as the plan says
                    break
        return run.finish()                              # metrics.json, or the early stop's one line

    main = experiment_main("mine", MyArgs, train, doc=__doc__)
    if __name__ == "__main__":
        main.run_and_exit()

The run's rules are components in ``ddp_core/lifecycle/`` (docs/design.md has the picture): the checkpointer,
the metrics log and the stop policy own their cadence; ``step`` is the coordinator that calls them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_core.config import check_values, parse_args, require, with_role
from ddp_core.distributed import flight_recorder
from ddp_core.distributed.group import DistContext, process_group, wrap_ddp
from ddp_core.errors import alike_on_the_node, exits_with_one_line
from ddp_core.lifecycle.loop import TrainingLoop
from ddp_core.lifecycle.plan import Evaluate, Plan, make_plan
from ddp_core.output.checkpoint import CheckpointArgs
from ddp_core.output.logging import RankZeroWriter, setup_logging
from ddp_core.output.run import Run, start_run
from ddp_core.process import heartbeat, timeline
from ddp_core.process.launch import launch
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.comm import CommHook, shard_optimizer
from ddp_core.training.seed import enable_determinism, loader_generator, seed_everything, speed_switches

A = TypeVar("A", bound=CheckpointArgs)  # a training experiment's options
log = logging.getLogger(__name__)
ORDER = "TrainingRun.plan(...), then resume_or_start(model, optimizer), then the loop"


class TrainingRun:
    """Entered once per training process: process group, stop signals, logging, determinism, run directory.

    ``experiment_main`` enters it; the experiment's ``train(run, args)`` gets it ready to use. Its phases are
    types: ``plan`` makes a ``Plan``, ``resume_or_start`` a ``TrainingLoop`` (``ddp_core/lifecycle/``), which
    the loop's calls go to; a call out of order fails with one line naming the order.
    """

    def __init__(self, name: str, args: CheckpointArgs) -> None:
        self.name, self.args = name, args
        self._plan: Plan | None = None
        self._loop: TrainingLoop | None = None
        self.comm = CommHook(args.comm_hook, args.powersgd_rank, args.powersgd_start_step)

    def __enter__(self) -> TrainingRun:
        with contextlib.ExitStack() as stack:  # a failure in here closes what was opened, in reverse order
            self.ctx: DistContext = stack.enter_context(process_group(self.args.dist_config()))
            timeline.mark("group")
            self.signals = stack.enter_context(GracefulStop())
            setup_logging()
            if self.args.deterministic:
                enable_determinism()
            speed_switches(self.ctx.device, self.args.deterministic)
            self.dir_run: Run = start_run(self.name, self.args, self.ctx, resume=self.args.resume)
            heartbeat.started(self.dir)  # every rank: where its launcher finds the checkpoint to resume from
            flight_recorder.dump_to(self.dir)  # a timed-out collective's record lands next to the run's other files
            seed_everything(self.args.seed)  # the same initial weights on every rank
            self._opened = stack.pop_all()
        return self

    def __exit__(self, *exc_info: Any) -> bool | None:
        self._loop = None  # the model and optimizer go before the process group does
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
        return self.dir_run.dir

    def wrap(self, model: nn.Module) -> nn.parallel.DistributedDataParallel:
        """The model on this rank's device, in DDP, with DDP's knobs as the flags set them (bucket size, static
        graph, gradients as bucket views, a communication hook: ddp_core/training/comm.py)."""
        args = self.args
        options = dict(bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph)
        wrapped = wrap_ddp(model, self.ctx, gradient_as_bucket_view=args.gradient_as_bucket_view, **options)
        self.comm.register(wrapped)
        return wrapped

    def loader_generator(self) -> torch.Generator:
        """A DataLoader's own generator: creating its iterator then leaves the global RNG as it was."""
        return loader_generator(self.args.seed, self.ctx.rank)

    # ------------------------------------------------------------------------------------ the phases

    def plan(
        self,
        loader: Any = None,
        *,
        total_steps: int,
        steps_per_epoch: int | None = None,
        batch_size: int | None = None,
        per_epoch: bool = False,
        grad_accum: int = 1,
        evaluate: Evaluate | None = None,
        unit: str = "samples",
    ) -> None:
        """The run's shape. ``loader`` (a DataLoader, or anything with ``len`` and ``batch_size``) gives the epoch's
        length in optimizer steps and the batch per process, unless ``steps_per_epoch`` or ``batch_size`` say
        otherwise. Without a loader or ``steps_per_epoch``: a run counted in steps alone (a stream of batches, no
        epochs: loop over ``run.batches(stream)`` without ``run.epochs()``). ``evaluate`` returns the evaluation's
        metrics, a dict or a result with ``as_metrics()`` (kept as ``run.last_evaluation``; logged as ``eval/NAME``,
        and as ``eval_NAME`` in metrics.json). ``per_epoch``: evaluate and checkpoint at each epoch's end. How often
        the run logs, evaluates and checkpoints is the user's: --log-every, --eval-every, --checkpoint-every."""
        if self._loop is not None:
            raise RuntimeError(f"TrainingRun.plan comes once, before resume_or_start: {ORDER}")
        self._plan = make_plan(
            loader,
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
            batch_size=batch_size,
            world_size=self.world_size,
            grad_accum=grad_accum,
            per_epoch=per_epoch,
            evaluate=evaluate,
            unit=unit,
            stop_at_step=self.args.stop_at_step,
            eval_every=self.args.eval_every,
        )

    def resume_or_start(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: torch.amp.GradScaler | None = None
    ) -> torch.optim.Optimizer:
        """Resuming: the checkpoint's model, optimizer, scaler, position and every rank's RNG states (bitwise at
        the same world size; ddp_core/lifecycle/checkpointer.py). Starting: each rank's own random streams.
        Returns the optimizer to step: ``optimizer`` itself, or under --zero the ZeroRedundancyOptimizer around it."""
        if self._plan is None or self._loop is not None:
            raise RuntimeError(f"resume_or_start comes once, after plan: {ORDER}")
        if self.args.zero:
            optimizer = shard_optimizer(optimizer)
        self._loop = TrainingLoop(
            self.name, self.args, self._plan, self.ctx, self.dir_run, self.signals, model, optimizer, scaler, self.comm
        )
        return optimizer

    @property
    def loop(self) -> TrainingLoop:
        if self._loop is None:
            raise RuntimeError(f"the loop needs a started run: {ORDER}")
        return self._loop

    # ------------------------------------------------------------------------------------ the loop

    def epochs(self) -> Iterator[tuple[int, int]]:
        """``(epoch, consumed)`` until the run ends or stops; ``consumed`` is how many of the epoch's samples
        the whole world trained on before a resume (0 otherwise): hand both to ``TrainSampler.set_epoch``."""
        return self.loop.epochs()

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The epoch's batches from ``loader`` (an incomplete accumulation at its end is dropped), with a
        progress bar on rank 0 at a terminal. Without ``epochs()`` (a run counted in steps): the whole run's."""
        return self.loop.batches(loader)

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: DDP all-reduces the gradients on the optimizer step's last
        micro-batch only (``model.no_sync()`` on the others: gradient accumulation without wasted communication)."""
        return self.loop.accumulate(model)

    @property
    def step_ready(self) -> bool:
        """Whether the micro-batch ``batches()`` handed out last completes an optimizer step (always, without
        gradient accumulation): then step the optimizer and call ``step``; else ``continue`` to the next one."""
        return self.loop.step_ready

    def observe(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (gradient accumulation); ``step`` observes its own ``loss`` itself."""
        self.loop.observe(loss)

    def step(self, loss: torch.Tensor | None = None, lr: float | None = None) -> bool:
        """After each optimizer step (ddp_core/lifecycle/loop.py says what it does, in which order). Returns True
        when the loop over batches must end: the epoch, the run, or a stop. ``lr``: the step's learning rate, for
        the curves (default: the optimizer's first group)."""
        return self.loop.step(loss, lr)

    @property
    def step_count(self) -> int:
        """Optimizer steps done, counting those before a resume."""
        return self.loop.position.step

    @property
    def writer(self) -> RankZeroWriter:
        return self.loop.metrics.writer

    @property
    def train_loss(self) -> float:
        return self.loop.metrics.train_loss

    @property
    def last_eval(self) -> dict[str, float] | None:
        return self.loop.metrics.last_eval

    @property
    def last_evaluation(self) -> Any:
        """What the experiment's evaluate() returned last, as it returned it."""
        return self.loop.metrics.last_evaluation

    @property
    def stopped(self) -> bool:
        """Stopped before its end (a signal, --stop-at-step): the checkpoint is written, the run not ended."""
        return self.loop.stopped

    def finish(self, extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The run's end. Stopped early: one line (why, and how to continue), no metrics.json.
        Finished: metrics.json (the last evaluation as ``eval_NAME``, the last train loss, throughput, and
        ``extra``, a dict or a function of nothing that returns one), TensorBoard's hparams, the writer closed."""
        return self.loop.finish(extra)

    def exit_if_stopped(self) -> None:
        self.signals.exit_if_stopped()


@dataclass
class ExperimentMain(Generic[A]):
    """An experiment's entry point: ``main(argv)`` in tests and ``main.run_and_exit()`` under ``__main__``."""

    name: str
    args_type: type[A]
    train: Callable[..., dict[str, Any]]
    description: str
    validate: Callable[[A], None] | None = None
    prepare: Callable[[A], Any] | None = None

    def __call__(self, argv: list[str] | None = None) -> dict[str, Any] | None:
        return _main(self, argv)

    def check(self, args: A) -> None:
        """Everything checked before any process starts (a ConfigError, exit 2): the declared ranges again, for
        arguments changed in code, --stop-at-step against --steps, and the experiment's own ``validate``."""
        check_values(args)
        args.check_resume_from()
        steps = with_role(args, "steps")  # a length in optimizer steps; one in epochs is checked by plan()
        if steps is not None:
            flag, total = steps
            require(
                args.stop_at_step <= total,
                f"--stop-at-step={args.stop_at_step} is beyond {flag}={total}: it must be at most {flag} (0: train "
                "to the end)",
            )
        if self.validate is not None:
            self.validate(args)

    def run_and_exit(self) -> NoReturn:
        from ddp_core.process.exit import run_and_exit

        run_and_exit(self)  # a finished worker leaves before gloo's teardown can abort it (docs/design.md)


@record  # a worker's traceback reaches torchrun's error summary
@exits_with_one_line  # a ConfigError is one line and exit code 2
def _main(main: ExperimentMain[A], argv: list[str] | None) -> dict[str, Any] | None:
    timeline.mark("imported")  # the interpreter is up, torch and the experiment imported (bench.recovery)
    args = parse_args(main.args_type, argv, description=main.description)
    with alike_on_the_node():  # every process of a node checks the same flags: a bad one is one line per node
        main.check(args)
    return launch(functools.partial(_train, main.name, main.train, main.prepare), args)


def _train(
    name: str, train: Callable[..., dict[str, Any]], prepare: Callable[[Any], Any] | None, args: CheckpointArgs
) -> dict[str, Any]:
    with alike_on_the_node():  # the node's files (a download, the data): every process there finds the same problem
        prepared = prepare(args) if prepare is not None else None  # before the group: no collective timeout runs out
    with TrainingRun(name, args) as run:
        metrics = train(run, args) if prepare is None else train(run, args, prepared)
    run.exit_if_stopped()  # a signal stopped it: exit 143, after the group is closed
    return metrics


def experiment_main(
    name: str,
    args_type: type[A],
    train: Callable[..., dict[str, Any]],
    *,
    doc: str | None,
    validate: Callable[[A], None] | None = None,
    prepare: Callable[[A], Any] | None = None,
) -> ExperimentMain[A]:
    """The entry point of the experiment ``name``: flags parsed into ``args_type`` and checked (``validate``,
    before any process starts), ``prepare(args)`` run before the process group (a download), then
    ``train(run, args[, prepared])`` inside a ``TrainingRun``, under torchrun, as a world of one or --nproc."""
    return ExperimentMain(name, args_type, train, (doc or name).strip().splitlines()[0], validate, prepare)
