"""The training loop, as ``Plan.resume_or_start`` returns it: where the experiment's epochs, optimizer steps and
micro-batches come from, and the coordinator of what ``step`` does after each optimizer step, in this order.

1. The step's loss goes to the non-finite guard and the interval's mean (one kernel each, no host read).
2. The position advances (``position.py``); the components say whether this step ends the run, stops it early
   (``stop_policy.py``), logs or evaluates (``metrics_log.py``), checkpoints (``checkpointer.py``), or checks
   the replicas.
3. If any of them is due: the guard's verdict (and the replica check) is taken on every rank first, with the
   model's weights before every save or evaluation; then the interval's loss is averaged over the ranks and
   logged (with every rank's compute and comm-wait time: ``rank_times.py``), the evaluation runs, the
   checkpoint is written, the epoch's line is logged.
   Read late (``--log-reads``, the default on CUDA: ``late_reads.py``), a log point with nothing else due does not
   pause: its figures are queued, and read at the next log point or before anything that may pause.
The time spent in 3 is not counted as training time, nor as a step's (``training/step_time.py``); a --profile
trace marks it ``ddp_lab.pause``. The loop also synchronizes once where the warm-up ends (``metrics_log.py``), and
times how long each save stalls it.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ddp_core import observers
from ddp_core.config import option, own
from ddp_core.distributed.group import DistContext, set_collective_timeout
from ddp_core.lifecycle.checkpointer import Checkpointer, CheckpointerArgs
from ddp_core.lifecycle.late_reads import LateReads, Sent, reads_late
from ddp_core.lifecycle.metrics_log import MetricsLog, MetricsLogArgs
from ddp_core.lifecycle.plan import Plan
from ddp_core.lifecycle.position import Position
from ddp_core.lifecycle.rank_times import RankTimes
from ddp_core.lifecycle.states import Kind, Named
from ddp_core.lifecycle.stop_policy import StopPolicy, StopPolicyArgs
from ddp_core.output.layout import PROFILE, memory_snapshot_name, profile_trace_name
from ddp_core.output.logging import progress
from ddp_core.output.run import RunDir
from ddp_core.process import heartbeat
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.comm import CommHook
from ddp_core.training.guard import VERDICT_COLUMNS
from ddp_core.training.profiling import PAUSE_ANNOTATION, ProfileArgs, StepProfiler
from ddp_core.training.seed import seed_rank_streams
from ddp_core.training.step_time import StepTimer

log = logging.getLogger(__name__)


@dataclass
class LoopArgs(ProfileArgs, StopPolicyArgs, MetricsLogArgs, CheckpointerArgs):
    """The loop's options: its own (gradient accumulation) and its components' (their cadences, the profiler's
    window)."""

    grad_accum: int = option(
        1, "micro-batches per optimizer step (gradients all-reduced on the last; x the global batch)", minimum=1
    )


class TrainingLoop:
    """The run once its model and optimizer exist: resumed or started, then driven by the experiment's loop.

    ``epochs()`` and ``steps(loader)`` hand out the work, ``backward(loss)`` each micro-batch's loss, ``step()``
    follows each optimizer step, ``finish()`` ends the run. Its parts are public: ``position`` (``position.step``:
    optimizer steps done, counting those before a resume), ``metrics`` (the TensorBoard ``writer``, the
    ``last_evaluation``), ``optimizer`` (the one to step: under --zero the sharded one).
    """

    def __init__(
        self,
        experiment: str,
        options: LoopArgs,
        plan: Plan,
        ctx: DistContext,
        run: RunDir,
        signals: GracefulStop,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        comm: CommHook,
        tracked: Iterable[Named] = (),
        *,
        seed: int,
        collective_timeout_s: float,
        config: dict[str, Any],
        other_world: bool,
    ) -> None:
        """``options``: the loop's own, handed on to each component; ``tracked``: the experiment's own states
        (``run.track``); ``collective_timeout_s``: how long a collective waits from the end of the first step on;
        ``config``: the run's options (recorded in checkpoints and as TensorBoard's hparams); ``other_world``: a
        resume may continue at another world size."""
        self.plan, self.ctx, self.model, self.optimizer = plan, ctx, model, optimizer
        self.scaler, self.collective_timeout_s = scaler, collective_timeout_s
        self.position = Position(plan.steps_per_epoch, plan.samples_per_step)
        self.checkpointer = Checkpointer(
            run,
            experiment,
            own(CheckpointerArgs, options),
            model,
            optimizer,
            scaler,
            comm,
            plan.per_epoch,
            self.position,
            tracked,
            seed=seed,
            config=config,
            other_world=other_world,
        )
        self.stops = StopPolicy(signals, own(StopPolicyArgs, options), model, ctx.device)
        for named in self.checkpointer.states.of(Kind.REPLICATED):
            if named.tracked:  # the same on every rank, as the model: compared with it
                self.stops.replicas.track(named.name, named.part)
        self.replay = None  # a resume's first step, run once more and undone (ddp_core/training/buckets.py)
        self.observer = observers.current()  # an instrument's (bench, the contract), None by default
        if self.observer is not None:
            self.observer.run_started(run.dir, ctx.rank)
        if run.resume:  # the checkpoint's state, or fresh per-rank streams
            observers.mark("loading")  # bench.recovery: set-up is done, the checkpoint is read next
            self.replay = self.checkpointer.resume(ctx.world_size, ctx.rank, on_undo=self._settled)
            observers.mark("loaded", step=self.position.step)
            self.stops.resumed_at(self.position.step)
        else:
            seed_rank_streams(seed, ctx.rank)  # from here on, random draws differ per rank
        self.timer = StepTimer(model, ctx.device, on_synced_pass=comm.count_pass)  # compute and comm wait per step
        ranks = RankTimes(self.timer, comm, run.hosts)
        resumed_at = self.position.step if run.resume else None
        self.metrics = MetricsLog(run, own(MetricsLogArgs, options), plan, ctx.device, resumed_at, ranks, config)
        self.late = LateReads() if reads_late(options.log_reads, ctx.device) else None
        self._marked_at = 0  # the step the step timer was last marked at (a log point read late)
        self.checkpointer.add("metrics", self.metrics)
        folder = run.dir / PROFILE  # --profile's window (training/profiling.py): each rank writes its own files
        trace, memory = folder / profile_trace_name(ctx.rank), folder / memory_snapshot_name(ctx.rank)
        self.profiler = StepProfiler(
            options.profile, plan.total_steps, self.position.step, ctx.device, ctx.rank, trace, memory, self.metrics
        )
        self.done = self.position.step >= plan.total_steps
        self.epochs_driven = False  # epochs() drives steps(); else the run is counted in steps alone
        # What set-up made (torch's and the libraries' modules, the model, the data) lives as long as the run: out
        # of the collector's generations, each collection during training walks only what the steps make. Without
        # this, the collections that the steps' allocations trigger walked every object of the imports too.
        gc.collect()
        gc.freeze()
        log.info(
            "run directory %s; %d process(es), backend %s/%s, global batch %d, %d steps (%d per epoch, loss every %d)",
            run.dir,
            ctx.world_size,
            ctx.backend,
            ctx.device.type,
            plan.samples_per_step,
            plan.total_steps,
            plan.steps_per_epoch,
            self.metrics.every,
        )

    # ------------------------------------------------------------------------------------ the loop

    def epochs(self) -> Iterator[tuple[int, int]]:
        """``(epoch, consumed)`` until the run ends or stops; ``consumed`` is how many of the epoch's samples the
        whole world trained on before a resume (0 otherwise): hand both to ``TrainSampler.set_epoch``."""
        self.epochs_driven = True
        while not self.done:
            self._begin_epoch()
            yield self.position.epoch, self.position.consumed

    def _begin_epoch(self) -> None:
        self.position.begin_epoch()
        self.metrics.begin_epoch()

    def steps(self, loader: Iterable[Any]) -> Iterator[Iterator[Any]]:
        """The epoch's optimizer steps from ``loader`` (without ``epochs()``, a run counted in steps: the whole
        run's), each an iterator over its --grad-accum micro-batches (an incomplete accumulation at the epoch's end
        is dropped). DDP all-reduces the gradients in the backward of a step's last micro-batch only
        (``model.no_sync()`` on the others). Take every micro-batch of a step, then step the optimizer and call
        ``step()``. A progress bar on rank 0 at a terminal."""
        with contextlib.closing(self._batches(loader)) as batches:
            for first in batches:
                yield self._micro_batches(first, batches)

    def _micro_batches(self, first: Any, rest: Iterator[Any]) -> Iterator[Any]:
        accumulate = self.plan.grad_accum
        ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)  # a world of one trains without it
        for index, batch in enumerate(itertools.chain([first], itertools.islice(rest, accumulate - 1))):
            last = index == accumulate - 1
            with self.model.no_sync() if ddp and not last else contextlib.nullcontext():  # its forward and backward
                yield batch

    def _batches(self, loader: Iterable[Any]) -> Generator[Any, None, None]:
        plan, position = self.plan, self.position
        if not self.epochs_driven:
            if self.done:
                return
            self._begin_epoch()
        remaining = position.steps_left(loader, plan.grad_accum)
        if remaining <= 0:  # resumed at another world size with fewer samples left than one step: the epoch is over
            position.end_epoch()
            self.done = position.step >= plan.total_steps
            return
        total = plan.steps_per_epoch * plan.grad_accum
        bar = self.metrics.bar = progress(
            loader, total=total, initial=total - remaining * plan.grad_accum, desc=f"epoch {position.epoch + 1}"
        )
        batches = (batch for _, batch in zip(range(remaining * plan.grad_accum), bar))
        # a resume's first step: run, undone, run again (bitwise buckets)
        stream = self.replay.batches(batches, plan.grad_accum) if self.replay is not None else batches
        try:
            for batch in stream:
                if not self.replaying:
                    self.profiler.begin_step(position.step + 1)
                if self.observer is not None and not self.replaying:
                    self.observer.batch(position.step + 1, batch)
                yield batch
        finally:
            bar.close()

    def _settled(self) -> None:
        """DDP's buckets are settled: the replay is over, and the time before was set-up, not training."""
        self.replay = None
        self.metrics.restart_clocks()

    @property
    def replaying(self) -> bool:
        return self.replay is not None and self.replay.active

    def backward(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (the mean over its samples): watched by the non-finite guard and added to the log
        interval's mean (one kernel each, no host read), divided by --grad-accum (the step's gradient is the mean
        over its micro-batches), scaled by the GradScaler given to ``resume_or_start`` (fp16: small gradients do not
        underflow), and back-propagated."""
        if not self.replaying:  # the resume's settling pass counts nothing
            self.stops.observe(loss, self.position.step + 1)
            self.metrics.observe(loss)
        if self.plan.grad_accum > 1:
            loss = loss / self.plan.grad_accum
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, lr: float | None = None) -> bool:
        """After each optimizer step (the module docstring says what it does, in which order). Returns True when
        the loop over ``steps()`` must end: the epoch, the run, or a stop. ``lr``: the step's learning rate, for
        the curves (default: the optimizer's first group's)."""
        if self.replaying:
            return False  # the resume's first step, run once to settle DDP's buckets and undone: it counts nothing
        epoch = self.position.epoch  # the epoch this step trained in
        epoch_done = self.position.advance()
        self.metrics.count_step()
        step = self.position.step
        heartbeat.beat(step)  # the step a killed rank had reached, for its launcher's report
        end = step >= self.plan.total_steps
        epoch_end = self.plan.per_epoch and epoch_done  # evaluated, logged, checkpointed
        log_due = self.metrics.log_due(step)
        lr = self.optimizer.param_groups[0]["lr"] if lr is None else lr
        save_due = self.checkpointer.due(step, last=end, epoch_end=epoch_end)  # and where the run stops
        evaluate = self.metrics.evaluation_due(step, last=end, epoch_end=epoch_end)
        # whether the loop pauses after this step whatever the signals say (a stop pauses too)
        pausing = (
            save_due
            or evaluate
            or epoch_end
            or step == self.stops.stop_at_step
            or self.stops.replicas_due(step, saving=False)
            or (log_due and self.late is None)
        )
        # read late (late_reads.py): the last log point's figures, at the next one or before anything may pause (a
        # checkpoint is written only after the guard's verdict on every step before it)
        signalled = self.late is not None and (log_due or pausing) and self._receive_late(step, lr)
        # Asking the other ranks about a signal syncs the GPU: on CUDA only where the loop pauses anyway (read late,
        # the signals also ride the log points' figures).
        ask = pausing or (self.late is None and self.ctx.device.type == "cpu")
        # asking is a collective: the time in it is spent waiting for the slowest rank (not asking waits on nobody,
        # and on CUDA each mark is an event the host records)
        with self.timer.waiting() if ask else contextlib.nullcontext():
            stopping = not end and self.stops.stops_at(step, ask_signals=ask, signalled=signalled)
        self.timer.end_step()
        save = save_due or stopping
        compare = self.stops.replicas_due(step, saving=save)
        if self.metrics.warmup_ends(step, epoch_done=epoch_done):
            self.metrics.end_warmup()
        if save or evaluate or epoch_end or compare or (log_due and self.late is None):
            self.metrics.pause_clock()
            with record_function(PAUSE_ANNOTATION):  # marked in a --profile trace: the clock leaves it out
                if epoch_end and self.observer is not None:
                    self.observer.epoch_trained(epoch + 1)  # bench.step_overhead's pause, where it asks for one
                weights = self.model if save or evaluate else None
                self.stops.check(step, weights, compare, self.checkpointer.kept, lr)
                self.metrics.log_train(step, epoch, lr)
                if evaluate:
                    self.metrics.evaluate(step)
                if save:
                    began = time.perf_counter()
                    self.checkpointer.save(step)
                    self.metrics.checkpoint_stalled(time.perf_counter() - began)
                    if end or stopping:  # the run ends here: its last checkpoint on disk (written in the background)
                        self.checkpointer.run.checkpoints.wait()
                if epoch_end:
                    self.metrics.log_epoch(step, self.position.epoch)
            self.metrics.resume_clock()
        elif log_due:  # read late: queued behind the step's kernels, nothing waits for the GPU here
            self._send_late(step, epoch, lr)
        self.profiler.end_step(step, last=end or stopping)
        self.timer.start_step()
        self.done = end or stopping
        if step == self.position.start + 1:  # set-up is over on every rank: from here on a wait this long is a hang
            observers.mark("first_step", step=step)
            set_collective_timeout(self.collective_timeout_s)
        return self.done or epoch_done

    def _send_late(self, step: int, epoch: int, lr: float) -> None:
        """The log point's figures, queued (``late_reads.py``): the guard's row, the interval's loss sum and count,
        the step times up to the last log point (their events have completed), this rank's signal flag."""
        guard, signal = self.stops.late_row()
        loss_sum, interval = self.metrics.interval_row(marked=True)
        times_step, self._marked_at = self._marked_at, step
        self.timer.mark()  # the steps up to this one: the next log point's to read
        assert self.late is not None
        self.late.send(Sent(step, epoch, lr, times_step), torch.cat([guard, loss_sum]), [*interval, signal])

    def _receive_late(self, step: int, lr: float) -> bool:
        """The last log point's figures, every rank's row (the guard's columns, the metrics log's, the signal flag):
        a divergence raised now on every rank (``step``: where it stopped), the line logged under its own step.
        Returns whether any rank got a stop signal."""
        assert self.late is not None
        received = self.late.receive()
        if received is None:
            return False
        sent, rows = received
        self.stops.judge_late([row[:VERDICT_COLUMNS] for row in rows], step, self.checkpointer.kept, lr)
        metrics = [row[VERDICT_COLUMNS:-1] for row in rows]
        self.metrics.record_train(sent.step, sent.epoch, sent.lr, metrics, times_step=sent.times_step)
        return any(row[-1] for row in rows)

    # ------------------------------------------------------------------------------------ the end

    @property
    def stopped(self) -> bool:
        """Stopped before its end (a signal, --stop-at-step): the checkpoint is written, the run not ended."""
        return self.position.step < self.plan.total_steps

    def finish(self, extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The run's end. Stopped early: one line (why, and how to continue), no metrics.json. Finished:
        metrics.json (the last evaluation as ``eval_NAME``, the last train loss, throughput, and ``extra``, a dict
        or a function of nothing that returns one), TensorBoard's hparams, the writer closed."""
        step = self.position.step
        self.profiler.close()  # a run whose loop ended inside the window
        if self.late is not None:  # an experiment that left its loop between a log point and a pause
            self._receive_late(step, self.optimizer.param_groups[0]["lr"])
        if self.stopped:
            self.metrics.writer.close()
            self.stops.report(step, self.checkpointer.run.dir, self.plan.total_steps)
            return {"steps": step, "stopped_early": True}
        return self.metrics.finish(step, self.ctx.world_size, extra)
