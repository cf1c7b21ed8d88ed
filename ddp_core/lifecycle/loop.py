"""The training loop's coordinator: what ``TrainingRun.step`` does after each optimizer step, in this order.

1. The step's loss goes to the non-finite guard and the interval's mean (device arithmetic, no host read).
2. The position advances (``position.py``); the components say whether this step ends the run, stops it early
   (``stop_policy.py``), logs or evaluates (``metrics_log.py``), checkpoints (``checkpointer.py``), or checks
   the replicas.
3. If any of them is due: the guard's verdict (and the replica check) is taken on every rank first, with the
   model's weights before every save or evaluation; then the interval's loss is averaged over the ranks and
   logged (with every rank's compute and comm-wait time: ``rank_times.py``), the evaluation runs, the
   checkpoint is written, the epoch's line is logged.
The time spent in 3 is not counted as training time, nor as a step's (``training/step_time.py``); the loop also
synchronizes once where the warm-up ends (``metrics_log.py``), and times how long each save stalls it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ddp_core.distributed.group import DistContext, set_collective_timeout
from ddp_core.lifecycle.checkpointer import Checkpointer
from ddp_core.lifecycle.metrics_log import MetricsLog
from ddp_core.lifecycle.plan import Plan
from ddp_core.lifecycle.position import Position
from ddp_core.lifecycle.rank_times import RankTimes
from ddp_core.lifecycle.stop_policy import StopPolicy
from ddp_core.output.checkpoint import CheckpointArgs
from ddp_core.output.layout import PROFILE, memory_snapshot_name, profile_trace_name
from ddp_core.output.logging import progress
from ddp_core.output.run import Run
from ddp_core.process import heartbeat, timeline
from ddp_core.process.preemption import GracefulStop
from ddp_core.training.comm import CommHook
from ddp_core.training.profiling import StepProfiler
from ddp_core.training.seed import seed_rank_streams
from ddp_core.training.step_time import StepTimer
from ddp_core.training.trace import BatchTrace

log = logging.getLogger(__name__)


class TrainingLoop:
    """The run once its model and optimizer exist: resumed or started, then driven by the experiment's loop."""

    def __init__(
        self,
        experiment: str,
        args: CheckpointArgs,
        plan: Plan,
        ctx: DistContext,
        run: Run,
        signals: GracefulStop,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        comm: CommHook,
    ) -> None:
        self.args, self.plan, self.ctx, self.model, self.optimizer = args, plan, ctx, model, optimizer
        self.position = Position(plan.steps_per_epoch, plan.samples_per_step)
        self.checkpointer = Checkpointer(run, experiment, args, model, optimizer, scaler, comm, plan.per_epoch)
        self.stops = StopPolicy(signals, args, model, ctx.device)
        self.replay = None  # a resume's first step, run once more and undone (ddp_core/training/buckets.py)
        if run.resume:  # the checkpoint's state, or fresh per-rank streams
            timeline.mark("loading")  # bench.recovery: set-up is done, the checkpoint is read next
            self.replay = self.checkpointer.resume(self.position, ctx.world_size, ctx.rank, on_undo=self._settled)
            timeline.mark("loaded", step=self.position.step)
            self.stops.resumed_at(self.position.step)
        else:
            seed_rank_streams(args.seed, ctx.rank)  # from here on, random draws differ per rank
        self.timer = StepTimer(model, ctx.device, on_synced_pass=comm.count_pass)  # compute and comm wait per step
        ranks = RankTimes(self.timer, comm, run.hosts)
        self.metrics = MetricsLog(run, args, plan, ctx.device, self.position.step if run.resume else None, ranks)
        self.trace = BatchTrace.for_run(run.dir, ctx.rank)  # the contract's record of what each step trained on
        folder = run.dir / PROFILE  # --profile's window (training/profiling.py): each rank writes its own files
        trace, memory = folder / profile_trace_name(ctx.rank), folder / memory_snapshot_name(ctx.rank)
        self.profiler = StepProfiler(
            args.profile, plan.total_steps, self.position.step, ctx.device, ctx.rank, trace, memory, self.metrics
        )
        self.done = self.position.step >= plan.total_steps
        self.epochs_driven = False  # epochs() drives batches(); else the run is counted in steps alone
        self.micro_batches = 0  # handed out by this batches() pass: where gradient accumulation stands
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
        self.epochs_driven = True
        while not self.done:
            self._begin_epoch()
            yield self.position.epoch, self.position.consumed

    def _begin_epoch(self) -> None:
        self.position.begin_epoch()
        self.metrics.begin_epoch()

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
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
        self.micro_batches = 0  # every pass starts at a step boundary
        try:
            for batch in stream:
                if not self.replaying:
                    self.profiler.begin_step(position.step + 1)
                self.micro_batches += 1
                if self.trace is not None and not self.replaying:
                    self.trace.record(position.step + 1, batch)
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

    @property
    def step_ready(self) -> bool:
        return self.micro_batches % self.plan.grad_accum == 0

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.step_ready else model.no_sync()

    def observe(self, loss: torch.Tensor) -> None:
        if self.replaying:
            return
        self.stops.observe(loss, self.position.step + 1)
        self.metrics.observe(loss)

    def step(self, loss: torch.Tensor | None = None, lr: float | None = None) -> bool:
        if self.replaying:
            return False  # the resume's first step, run once to settle DDP's buckets and undone: it counts nothing
        if loss is not None:
            self.observe(loss)
        epoch = self.position.epoch  # the epoch this step trained in
        epoch_done = self.position.advance()
        self.metrics.count_step()
        step = self.position.step
        heartbeat.beat(step)  # the step a killed rank had reached, for its launcher's report
        end = step >= self.plan.total_steps
        epoch_end = self.plan.per_epoch and epoch_done  # evaluated, logged, checkpointed
        log_due = self.metrics.log_due(step)
        # Asking the other ranks about a signal syncs the GPU: on CUDA once per log interval (and epoch).
        ask = self.ctx.device.type == "cpu" or log_due or epoch_end
        with self.timer.waiting():  # asking is a collective: the time in it is spent waiting for the slowest rank
            stopping = not end and self.stops.stops_at(step, ask_signals=ask)
        self.timer.end_step()
        save = self.checkpointer.due(step, last=end or stopping, epoch_end=epoch_end)
        evaluate = self.metrics.evaluation_due(step, last=end, epoch_end=epoch_end)
        compare = self.stops.replicas_due(step, saving=save)
        if self.metrics.warmup_ends(step, epoch_done=epoch_done):
            self.metrics.end_warmup()
        if save or evaluate or log_due or epoch_end or compare:
            self.metrics.pause_clock()
            weights = self.model if save or evaluate else None
            self.stops.check(step, weights, compare, self.checkpointer.run.checkpoint_path)
            self.metrics.log_train(step, epoch, self.optimizer.param_groups[0]["lr"] if lr is None else lr)
            if evaluate:
                self.metrics.evaluate(step)
            if save:
                began = time.perf_counter()
                self.checkpointer.save(self.position, self.metrics.train_loss)
                self.metrics.checkpoint_stalled(time.perf_counter() - began)
            if epoch_end:
                self.metrics.log_epoch(step, self.position.epoch)
            self.metrics.resume_clock()
        self.profiler.end_step(step, last=end or stopping)
        self.timer.start_step()
        self.done = end or stopping
        if step == self.position.start + 1:  # set-up is over on every rank: from here on a wait this long is a hang
            timeline.mark("first_step", step=step)
            set_collective_timeout(self.args.dist_timeout_s)
        return self.done or epoch_done

    # ------------------------------------------------------------------------------------ the end

    @property
    def stopped(self) -> bool:
        return self.position.step < self.plan.total_steps

    def finish(self, extra: dict[str, Any] | Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
        step = self.position.step
        self.profiler.close()  # a run whose loop ended inside the window
        if self.stopped:
            self.metrics.writer.close()
            self.stops.report(step, self.checkpointer.run.dir, self.plan.total_steps)
            return {"steps": step, "stopped_early": True}
        return self.metrics.finish(step, self.ctx.world_size, extra)
