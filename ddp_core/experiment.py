"""One run object that owns every rule of a training run, so that an experiment is its training logic.

An experiment writes its model, data, an explicit loop and its evaluation; ``TrainingRun`` carries the
rest, each rule in one place::

    def train(run: TrainingRun, args: MyArgs) -> dict[str, float]:
        model = run.wrap(MyModel())                     # the same initial weights on every rank
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        sampler = TrainSampler(len(data), run.rank, run.world_size, seed=args.seed)
        loader = DataLoader(data, args.batch_size, sampler=sampler, drop_last=True, generator=run.loader_generator())
        run.plan(loader, total_steps=args.steps, log_every=20)  # the epoch's length and the batch: the loader's
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

What ``step`` does after each optimizer step, in this order (docs/new-experiment.md explains why):
the loss goes to the non-finite guard (device arithmetic, no host read); the run decides whether this
step ends the run, stops it early (``--stop-at-step``, or a signal any rank got: asked every step on
CPU, once per log interval on CUDA, where asking syncs the GPU), logs, evaluates or checkpoints; the
guard's verdict is taken on every rank before anything is logged, evaluated or saved, with the model's
weights before every save; the loss of the interval is averaged over the ranks with one collective.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_core.config import check_values, parse_args, require, with_role
from ddp_core.distributed import flight_recorder
from ddp_core.distributed.group import DistContext, process_group, set_collective_timeout, wrap_ddp
from ddp_core.errors import AgreedConfigError, exits_with_one_line
from ddp_core.output.checkpoint import CheckpointArgs, restore
from ddp_core.output.logging import RankZeroWriter, progress, setup_logging
from ddp_core.output.run import Run, start_run
from ddp_core.process.launch import launch
from ddp_core.process.preemption import GracefulStop
from ddp_core.ranks import is_global_rank0
from ddp_core.training.amp import restore_scaler, scaler_state
from ddp_core.training.buckets import FirstStepReplay, rebuilds_buckets
from ddp_core.training.guard import NonFiniteGuard
from ddp_core.training.metrics import log_interval
from ddp_core.training.replicas import ReplicaCheck
from ddp_core.training.samplers import global_sum_count
from ddp_core.training.seed import (
    enable_determinism,
    loader_generator,
    seed_everything,
    seed_rank_streams,
    speed_switches,
)
from ddp_core.training.trace import BatchTrace

A = TypeVar("A", bound=CheckpointArgs)  # a training experiment's options
log = logging.getLogger(__name__)


class Evaluation(Protocol):
    """What an experiment's evaluation may return beside a plain dict: a result that names its metrics."""

    def as_metrics(self) -> dict[str, float]: ...


Evaluate = Callable[[], "dict[str, float] | Evaluation"]


@dataclass
class Plan:
    """When the run logs, evaluates, checkpoints and ends; set once by ``TrainingRun.plan``."""

    total_steps: int
    steps_per_epoch: int
    samples_per_step: int  # the global batch: per-process batch x processes x micro-batches
    log_every: int
    checkpoint_every: int = 0
    eval_every: int = 0
    per_epoch: bool = False  # evaluate and checkpoint at each epoch's end
    grad_accum: int = 1
    evaluate: Evaluate | None = None
    unit: str = "samples"
    check_replicas_every: int = 0  # --check-replicas-every, where the run has it


class TrainingRun:
    """Entered once per training process: process group, stop signals, logging, determinism, run directory.

    ``experiment_main`` enters it; the experiment's ``train(run, args)`` gets it ready to use.
    """

    def __init__(self, name: str, args: CheckpointArgs) -> None:
        self.name, self.args = name, args
        self.step_count = 0  # optimizer steps done, counting those before a resume
        self.epoch = 0  # the epoch being trained
        self.consumed = 0  # samples of this epoch the whole world has trained on: the position a resume carries
        self.train_loss = float("nan")  # the mean loss of the last log interval, over every rank
        self.last_eval: dict[str, float] | None = None  # the last evaluation's metrics
        self.last_evaluation: Any = None  # what the experiment's evaluate() returned, as it returned it
        self.writer: RankZeroWriter | None = None
        self._bar: Any = progress(())  # batches() replaces it with the epoch's bar
        self._epoch_clock, self._epoch_steps = time.perf_counter(), 0
        self._plan: Plan | None = None
        self._done = False
        self._epoch_end_step = 0  # the step that ends this epoch; set by epochs(), refined by batches()
        self._micro_batches = 0  # handed out by this batches() pass: where gradient accumulation stands
        self._epochs_driven = False  # epochs() drives batches(); else the run is counted in steps alone
        self._realign = False  # resumed at another world size: the first batches() fits the step count to the loader
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._replay: FirstStepReplay | None = None  # a resume's first step, run twice (ddp_core/training/buckets.py)

    # ------------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> TrainingRun:
        with contextlib.ExitStack() as stack:  # a failure in here closes what was opened, in reverse order
            self.ctx: DistContext = stack.enter_context(process_group(self.args.dist_config()))
            self.stop = stack.enter_context(GracefulStop())
            setup_logging()
            if self.args.deterministic:
                enable_determinism()
            speed_switches(self.ctx.device, self.args.deterministic)
            self.dir_run: Run = start_run(self.name, self.args, self.ctx, resume=self.args.resume)
            flight_recorder.dump_to(self.dir)  # a timed-out collective's record lands next to the run's other files
            seed_everything(self.args.seed)  # the same initial weights on every rank
            self._opened = stack.pop_all()
        return self

    def __exit__(self, *exc_info: Any) -> bool | None:
        self._model = self._optimizer = self._scaler = None  # gone before the process group is
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
        """The model on this rank's device, in DDP."""
        return wrap_ddp(model, self.ctx)

    def loader_generator(self) -> torch.Generator:
        """A DataLoader's own generator: creating its iterator then leaves the global RNG as it was."""
        return loader_generator(self.args.seed, self.ctx.rank)

    # ------------------------------------------------------------------------------------ the plan

    def plan(
        self,
        loader: Any = None,
        *,
        total_steps: int,
        steps_per_epoch: int | None = None,
        batch_size: int | None = None,
        log_every: int = 0,
        checkpoint_every: int = 0,
        eval_every: int = 0,
        per_epoch: bool = False,
        grad_accum: int = 1,
        evaluate: Evaluate | None = None,
        unit: str = "samples",
    ) -> None:
        """The run's cadence. ``loader`` (a DataLoader, or anything with ``len`` and ``batch_size``) gives the
        epoch's length in optimizer steps and the batch per process, unless ``steps_per_epoch`` or ``batch_size``
        say otherwise. Without a loader or ``steps_per_epoch``: a run counted in steps alone (a stream of batches,
        no epochs: loop over ``run.batches(stream)`` without ``run.epochs()``). ``log_every`` 0: about ten points an
        epoch. ``evaluate`` returns the evaluation's metrics, a dict or a result with ``as_metrics()`` (kept as
        ``run.last_evaluation``; the metrics are logged as ``eval/NAME``, and as ``eval_NAME`` in metrics.json);
        it runs at ``eval_every`` steps, at each epoch's end with ``per_epoch``, and always at the run's end."""
        if steps_per_epoch is None:
            steps_per_epoch = len(loader) // grad_accum if loader is not None else total_steps
        if batch_size is None:
            if loader is None or getattr(loader, "batch_size", None) is None:
                raise TypeError("TrainingRun.plan needs batch_size= (samples per process per micro-batch) or a loader")
            batch_size = int(loader.batch_size)
        # Every rank computes the same verdict from the same numbers: one line, printed by rank 0.
        if steps_per_epoch <= 0:
            raise AgreedConfigError(
                f"each of {self.world_size} processes gets fewer samples than one step needs (--batch-size={batch_size}"
                + (f", --grad-accum={grad_accum}" if grad_accum > 1 else "")
                + "): lower them or use more data"
            )
        if self.args.stop_at_step > total_steps:
            raise AgreedConfigError(
                f"--stop-at-step={self.args.stop_at_step} is beyond the run's {total_steps} steps: "
                "it must be at most that (0: train to the end)"
            )
        self._plan = Plan(
            total_steps,
            steps_per_epoch,
            batch_size * self.world_size * grad_accum,
            log_interval(steps_per_epoch, log_every),
            checkpoint_every,
            eval_every,
            per_epoch,
            grad_accum,
            evaluate,
            unit,
            self.args.check_replicas_every,
        )
        lr = with_role(self.args, "lr")
        advice = f"a lower {lr[0]} (now {lr[1]:g})" if lr else "a lower learning rate"
        self.guard = NonFiniteGuard(self.device, advice=advice)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss_count = 0

    # ------------------------------------------------------------------------------------ resume

    def resume_or_start(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """Resuming: the checkpoint's model, optimizer, scaler and every rank's RNG states; the first step then runs
        once more and is undone, so that DDP's buckets are laid out as in an uninterrupted run and the continuation
        is bitwise (ddp_core/training/buckets.py). Starting: each rank's own random streams."""
        plan = self._need_plan()
        self._model, self._optimizer, self._scaler = model, optimizer, scaler
        self._replicas = ReplicaCheck(model, self.device)
        resuming = self.dir_run.resume
        if resuming:
            checkpoint, path = self.dir_run.load_checkpoint()  # the newest that loads, or --resume-from's file
            written_world = checkpoint["world_size"]
            step = self._load(checkpoint)
            # checkpoints written before the position was stored in samples: derived from the step, as it was then
            self.consumed = int(
                checkpoint.get("extra", {}).get("epoch_samples", (step % plan.steps_per_epoch) * plan.samples_per_step)
            )
            self.step_count = step
            if written_world != self.world_size:
                self._continue_at_another_world_size(step, written_world)
            if rebuilds_buckets(model, self.world_size):
                scaler_before = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
                self._replay = FirstStepReplay(model, undo=lambda: self._undo_first_step(checkpoint, scaler_before))
            self._replicas.last_agreed = self.step_count  # a checkpoint holds agreeing replicas
            log.info("resumed %s at step %d", path, self.step_count)
        else:
            seed_rank_streams(self.args.seed, self.rank)  # from here on, random draws differ per rank
        self.writer = self.dir_run.open_writer(purge_step=self.step_count if resuming else None)
        self._trace = BatchTrace.for_run(self.dir, self.rank)  # the contract's record of what each step trained on
        self._done = self.step_count >= plan.total_steps
        log.info(
            "run directory %s; %d process(es), backend %s/%s, global batch %d, %d steps (%d per epoch, loss every %d)",
            self.dir,
            self.world_size,
            self.ctx.backend,
            self.device.type,
            plan.samples_per_step,
            plan.total_steps,
            plan.steps_per_epoch,
            plan.log_every,
        )
        self._first_step, self._trained_seconds, self._clock = self.step_count, 0.0, time.perf_counter()

    def _load(self, checkpoint: dict[str, Any]) -> int:
        """The checkpoint's model, optimizer and scaler (and this rank's random streams at the same world size)."""
        allow = self.args.allow_config_change
        step, self.epoch = restore(checkpoint, self._model, self._optimizer, other_world=allow)
        if self._scaler is not None:
            mismatch = restore_scaler(self._scaler, checkpoint.get("extra", {}))
            if mismatch:
                log.warning("%s; this resume will not be exact", mismatch)
        return step

    def _undo_first_step(self, checkpoint: dict[str, Any], scaler_before: dict[str, Any] | None) -> None:
        """After the resume's first step ran once to settle DDP's buckets: weights and optimizer back to the
        checkpoint's, the scaler to what it was before that step (also where the checkpoint held none), the clocks
        restarted (that step was set-up, not training)."""
        restore(checkpoint, self._model, self._optimizer, other_world=self.args.allow_config_change)
        if self._scaler is not None and scaler_before is not None:
            self._scaler.load_state_dict(scaler_before)
        self._replay = None
        self._clock = self._epoch_clock = time.perf_counter()

    def _continue_at_another_world_size(self, step: int, written_world: int) -> None:
        """--allow-config-change across world sizes: the epoch continues after the samples the old world trained
        on (the sampler deals the rest of its order to the new ranks), the step count becomes this world's at that
        position (so the schedule and the end stay where the new config puts them), and each rank gets fresh
        random streams (the old ranks' states do not map onto the new ones)."""
        plan = self._need_plan()
        self.step_count = self.epoch * plan.steps_per_epoch + self.consumed // plan.samples_per_step
        self._realign = True
        seed_rank_streams(self.args.seed, self.rank, step)  # not the streams the run started with
        if is_global_rank0():
            log.warning(
                "resuming a checkpoint of %d processes (step %d) at %d: epoch %d continues after the %d samples it "
                "trained on, with new random streams per rank; every sample is still seen once per epoch, but the "
                "continuation is not bitwise",
                written_world,
                step,
                self.world_size,
                self.epoch + 1,
                self.consumed,
            )

    def _need_plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("TrainingRun.plan(...) must come before resume_or_start and the loop")
        return self._plan

    # ------------------------------------------------------------------------------------ the loop

    def epochs(self) -> Iterator[tuple[int, int]]:
        """``(epoch, consumed)`` until the run ends or stops; ``consumed`` is how many of the epoch's samples
        the whole world trained on before a resume (0 otherwise): hand both to ``TrainSampler.set_epoch``."""
        self._need_plan()
        if self.writer is None:
            raise RuntimeError("TrainingRun.resume_or_start(model, optimizer, ...) must come before the loop")
        self._epochs_driven = True
        while not self._done:
            self._begin_epoch()
            yield self.epoch, self.consumed

    def _begin_epoch(self) -> None:
        plan = self._need_plan()
        self._epoch_clock, self._epoch_steps = time.perf_counter(), 0
        self._epoch_end_step = self.step_count + plan.steps_per_epoch - self.consumed // plan.samples_per_step

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The epoch's batches from ``loader`` (an incomplete accumulation at its end is dropped), with a
        progress bar on rank 0 at a terminal. Without ``epochs()`` (a run counted in steps): the whole run's."""
        plan = self._need_plan()
        if not self._epochs_driven:
            if self.writer is None:
                raise RuntimeError("TrainingRun.resume_or_start(model, optimizer, ...) must come before the loop")
            if self._done:
                return
            self._begin_epoch()
        remaining = self._epoch_end_step - self.step_count
        if self._realign:  # at another world size the sampler, not the plan, knows how many batches the epoch has left
            self._realign = False
            if hasattr(loader, "__len__"):
                remaining = len(loader) // plan.grad_accum  # type: ignore[arg-type]
                self.step_count = self._first_step = (self.epoch + 1) * plan.steps_per_epoch - remaining
                self._epoch_end_step = self.step_count + remaining
                if remaining == 0:  # fewer samples left than one step of this world takes: the epoch is over
                    self._end_epoch()
                    self._done = self.step_count >= plan.total_steps
                    return
        total = plan.steps_per_epoch * plan.grad_accum
        self._bar = progress(
            loader, total=total, initial=total - remaining * plan.grad_accum, desc=f"epoch {self.epoch + 1}"
        )
        batches = (batch for index, batch in zip(range(remaining * plan.grad_accum), self._bar))
        # a resume's first step: run, undone, run again (bitwise buckets)
        stream = self._replay.batches(batches, plan.grad_accum) if self._replay is not None else batches
        self._micro_batches = 0  # every pass starts at a step boundary
        try:
            for batch in stream:
                self._micro_batches += 1
                if self._trace is not None and not self._replaying:
                    self._trace.record(self.step_count + 1, batch)
                yield batch
        finally:
            self._bar.close()

    @property
    def step_ready(self) -> bool:
        """Whether the micro-batch ``batches()`` handed out last completes an optimizer step (always, without
        gradient accumulation): then step the optimizer and call ``step``; else ``continue`` to the next one."""
        return self._micro_batches % self._need_plan().grad_accum == 0

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: DDP all-reduces the gradients on the optimizer step's last
        micro-batch only (``model.no_sync()`` on the others: gradient accumulation without wasted communication)."""
        return contextlib.nullcontext() if self.step_ready else model.no_sync()

    @property
    def _replaying(self) -> bool:
        return self._replay is not None and self._replay.active

    def _end_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0

    def observe(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (gradient accumulation); ``step`` observes its own ``loss`` itself."""
        if self._replaying:
            return
        self.guard.observe(loss, self.step_count + 1)  # device arithmetic: no host read per step
        self._loss_sum += loss.detach().double()
        self._loss_count += 1

    def step(self, loss: torch.Tensor | None = None, lr: float | None = None) -> bool:
        """After each optimizer step. Returns True when the loop over batches must end: the epoch, the run,
        or a stop. ``lr``: the step's learning rate, for the curves (default: the optimizer's first group)."""
        plan = self._need_plan()
        if self._replaying:
            return False  # the resume's first step, run once to settle DDP's buckets and undone: it counts nothing
        if loss is not None:
            self.observe(loss)
        self.step_count += 1
        self._epoch_steps += 1
        self.consumed += plan.samples_per_step
        step, epoch = self.step_count, self.epoch
        end = step >= plan.total_steps
        epoch_done = step >= self._epoch_end_step
        if epoch_done:
            self._end_epoch()  # before a save: the checkpoint holds the next epoch, at its start
        epoch_end = plan.per_epoch and epoch_done  # evaluated, logged, checkpointed
        interval = step % plan.log_every == 0
        # Asking the other ranks about a signal syncs the GPU: on CUDA once per log interval (and epoch).
        ask = self.device.type == "cpu" or interval or epoch_end
        stopping = not end and (step == self.args.stop_at_step or (ask and self.stop.requested()))
        save = end or stopping or epoch_end or bool(plan.checkpoint_every and step % plan.checkpoint_every == 0)
        evaluate = plan.evaluate is not None and (
            end or epoch_end or bool(plan.eval_every and step % plan.eval_every == 0)
        )
        every = plan.check_replicas_every
        compare = bool(every) and (save or step % every == 0)  # a checkpoint is always of agreeing replicas
        if save or evaluate or interval or epoch_end or compare:
            self._pause_clock()
            self.guard.check(step, self._model if save or evaluate else None, self.dir_run.checkpoint_path)
            if compare:
                self._replicas.check(step, self.dir_run.checkpoint_path)
            self._log_train(lr, epoch)
            if evaluate:
                self._evaluate()
            if save:
                self._save()
            if epoch_end:
                self._log_epoch()
            self._clock = time.perf_counter()
        self._done = end or stopping
        if step == self._first_step + 1:  # set-up is over on every rank: from here on a wait this long is a hang
            set_collective_timeout(self.args.dist_timeout_s)
        return self._done or epoch_done

    def _pause_clock(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # where the loop synchronizes anyway: the time is the steps', not their launch's
        self._trained_seconds += time.perf_counter() - self._clock

    def _log_train(self, lr: float | None, epoch: int) -> None:
        plan = self._need_plan()
        if self._loss_count:
            total, count = global_sum_count(self._loss_sum, self._loss_count)  # one collective per interval
            self.train_loss = total / count
            self._loss_sum.zero_()
            self._loss_count = 0
        if lr is None and self._optimizer is not None:
            lr = self._optimizer.param_groups[0]["lr"]
        self.writer.add_scalars({"train/loss": self.train_loss, "train/lr": float(lr)}, self.step_count)
        log.info(
            "step %d/%d  epoch %d  loss %.5f  lr %.4g",
            self.step_count,
            plan.total_steps,
            epoch + 1,
            self.train_loss,
            lr,
        )
        self._bar.set_postfix(loss=f"{self.train_loss:.3f}", lr=f"{lr:.3g}")

    def _log_epoch(self) -> None:
        """One line per epoch: its evaluation and its training throughput (bench.gpu_report reads it)."""
        plan = self._need_plan()
        speed = self._epoch_steps * plan.samples_per_step / max(time.perf_counter() - self._epoch_clock, 1e-9)
        self.writer.add_scalar(f"train/{plan.unit}_per_s", speed, self.step_count)
        log.info(
            "epoch %d/%d  step %d  %s  %.0f %s/s",
            self.epoch,
            plan.total_steps // plan.steps_per_epoch,
            self.step_count,
            _show_eval(self.last_eval),
            speed,
            plan.unit,
        )

    def _evaluate(self) -> None:
        plan = self._need_plan()
        result = plan.evaluate()
        self.last_evaluation = result
        self.last_eval = result if isinstance(result, dict) else result.as_metrics()
        self.writer.add_scalars({f"eval/{name}": value for name, value in self.last_eval.items()}, self.step_count)
        if not plan.per_epoch:
            log.info("step %d  %s", self.step_count, _show_eval(self.last_eval))

    def _save(self) -> None:
        # The experiment and its config: a resume checks that it continues this run
        # (ddp_core.output.run.check_same_run).
        extra = {
            "train_loss": self.train_loss,
            "experiment": self.name,
            "config": asdict(self.args),
            "epoch_samples": self.consumed,
            **(scaler_state(self._scaler) if self._scaler is not None else {}),
        }
        self.dir_run.save_checkpoint(self._model, self._optimizer, self.step_count, self.epoch, extra=extra)

    # ------------------------------------------------------------------------------------ the end

    @property
    def stopped(self) -> bool:
        """Stopped before its end (a signal, --stop-at-step): the checkpoint is written, the run not ended."""
        return self.step_count < self._need_plan().total_steps

    def finish(self, extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The run's end. Stopped early: one line on every rank (why, and how to continue), no metrics.json.
        Finished: metrics.json (the last evaluation as ``eval_NAME``, the last train loss, throughput, and
        ``extra``, a dict or a function of nothing that returns one), TensorBoard's hparams, the writer closed."""
        plan = self._need_plan()
        if self.stopped:
            self.writer.close()
            self.stop.report(self.step_count, self.dir, plan.total_steps)  # every rank; exit 143 after a signal
            return {"steps": self.step_count, "stopped_early": True}
        if plan.evaluate is not None and self.last_eval is None:  # resumed a finished run: evaluate once
            self._evaluate()
        evaluation = {f"eval_{name}": value for name, value in (self.last_eval or {}).items()}
        metrics = {
            **evaluation,
            "final_loss": self.train_loss,
            "steps": self.step_count,
            "world_size": self.world_size,
            "global_batch_size": plan.samples_per_step,
            f"{plan.unit}_per_s": (self.step_count - self._first_step)
            * plan.samples_per_step
            / max(self._trained_seconds, 1e-9),
            **((extra() if callable(extra) else extra) or {}),
        }
        if torch.cuda.is_initialized():  # rank 0's GPU: ranks hold the same model and batch size
            metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        headline = evaluation or {"final_loss": self.train_loss}
        self.writer.add_hparams(
            asdict(self.args), {f"hparam/{name}": value for name, value in headline.items()}, self.step_count
        )
        self.writer.close()
        self.dir_run.finish(metrics)  # metrics.json, by rank 0 only
        shown = _show_eval(self.last_eval) if self.last_eval else f"final loss {self.train_loss:.4f}"
        log.info("done after %d steps: %s; %s (view: make tensorboard)", self.step_count, shown, self.dir)
        return metrics

    def exit_if_stopped(self) -> None:
        self.stop.exit_if_stopped()


def _show_eval(values: dict[str, float] | None) -> str:
    """``eval accuracy 0.9120  eval loss 0.4100  eval samples 10000``: counts as integers, the rest to 4 places."""
    return "  ".join(
        f"eval {name} {int(value) if float(value).is_integer() and abs(value) >= 1 else f'{value:.4f}'}"
        for name, value in (values or {}).items()
    )


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
    args = parse_args(main.args_type, argv, description=main.description)
    main.check(args)
    return launch(functools.partial(_train, main.name, main.train, main.prepare), args)


def _train(
    name: str, train: Callable[..., dict[str, Any]], prepare: Callable[[Any], Any] | None, args: CheckpointArgs
) -> dict[str, Any]:
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
