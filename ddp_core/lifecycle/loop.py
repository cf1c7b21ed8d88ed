"""The training loop, as ``Plan.resume_or_start`` returns it: where the experiment's epochs, optimizer steps and
micro-batches come from, and the coordinator of what ``step`` does after each optimizer step, in this order.

1. The step's loss goes to the non-finite guard and the interval's mean (one kernel each, no host read).
2. The position advances (``position.py``); the components say whether this step ends the run, stops it early
   (``stop_policy.py``), logs or evaluates (``metrics_log.py``), checkpoints (``checkpointer.py``), or checks
   the replicas: one ``Due``, decided once, that the rest of the step acts on.
3. If the step pauses (anything but a log point read late is due): the guard's verdict (and the replica check)
   is taken on every rank first, with the model's weights before every save or evaluation; then, at a log point
   only (a multiple of --log-every, or the run's last planned step), the interval's loss is averaged over the
   ranks and logged (with every rank's compute and comm-wait time: ``rank_times.py``); the evaluation runs, the
   checkpoint is written, the epoch's line is logged. A pause adds no loss point: the interval runs on.
   Read late (``--log-reads``, the default on CUDA: ``late_reads.py``), a log point with nothing else due does not
   pause: its figures (``log_point.py``) are queued, and read at the next log point or before anything that may
   pause.
The time spent in 3 is not counted as training time, nor as a step's (``training/step_time.py``); a --profile
trace marks it ``ddp_lab.pause``. The loop also synchronizes once where the warm-up ends (``metrics_log.py``), and
times how long each save stalls it. Its parts are built before it (``parts.py``) and handed in.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ddp_core import observers
from ddp_core.config import option
from ddp_core.distributed.group import DistContext, set_collective_timeout
from ddp_core.lifecycle.checkpointer import CheckpointerArgs, Trained
from ddp_core.lifecycle.heal import CommitGate
from ddp_core.lifecycle.late_reads import Sent
from ddp_core.lifecycle.log_point import LogPoint, LogRow
from ddp_core.lifecycle.metrics_log import MetricsLogArgs
from ddp_core.lifecycle.parts import Parts
from ddp_core.lifecycle.plan import Plan
from ddp_core.lifecycle.stop_policy import StopPolicyArgs
from ddp_core.output.logging import RankZeroWriter
from ddp_core.process import heartbeat
from ddp_core.training.profiling import PAUSE_ANNOTATION, ProfileArgs
from ddp_core.training.seed import get_rng_state, seed_rank_streams, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class LoopArgs(ProfileArgs, StopPolicyArgs, MetricsLogArgs, CheckpointerArgs):
    """The loop's options: its own (gradient accumulation) and its components' (their cadences, the profiler's
    window)."""

    grad_accum: int = option(
        1, "micro-batches per optimizer step (gradients all-reduced on the last; x the global batch)", minimum=1
    )


@dataclass(frozen=True, slots=True)
class Due:
    """What falls due after one optimizer step, decided once (``TrainingLoop._due``) from the components' answers."""

    end: bool  # the run's last step
    epoch_end: bool  # an epoch ended where the plan evaluates and checkpoints per epoch
    log: bool  # a train-loss point: a multiple of --log-every, or the run's last planned step
    read_now: bool  # a log point is read at once (else late: queued, read at the next one or pause)
    evaluate: bool
    save: bool  # a checkpoint (a stop writes one)
    replicas: bool  # the replica check
    stop: bool  # stops early here: a signal, --stop-at-step

    @property
    def pauses(self) -> bool:
        """The loop pauses after the step, its clock stopped: to read at once, evaluate, save or compare."""
        return self.save or self.evaluate or self.epoch_end or self.replicas or (self.log and self.read_now)

    @property
    def last(self) -> bool:
        """The run ends or stops here."""
        return self.end or self.stop


class TrainingLoop:
    """The run once its model and optimizer exist: resumed or started, then driven by the experiment's loop.

    ``epochs()`` and ``steps(loader)`` hand out the work, ``backward(loss)`` each micro-batch's loss, ``step()``
    follows each optimizer step, ``finish()`` ends the run. For the experiment: ``global_step`` (optimizer steps
    done, counting those before a resume), ``writer`` (TensorBoard's, rank 0 writes), ``last_evaluation`` (what
    the evaluation returned last), ``optimizer`` (the one to step: under --zero the sharded one).
    """

    def __init__(
        self, plan: Plan[Any], parts: Parts, ctx: DistContext, trained: Trained, *, collective_timeout_s: float
    ) -> None:
        """``parts``: the components, built and resumed (``parts.py``); ``collective_timeout_s``: how long a
        collective waits from the end of the first step on."""
        self.plan, self.ctx, self.collective_timeout_s = plan, ctx, collective_timeout_s
        self.model, self.optimizer, self.scaler = trained.model, trained.optimizer, trained.scaler
        self.position, self.checkpointer, self.stops = parts.position, parts.checkpointer, parts.stops
        self.metrics, self.timer, self.profiler, self.late = parts.metrics, parts.timer, parts.profiler, parts.late
        self.replay, self._replay_next = parts.replay, parts.replay  # the first pass over a loader replays a step
        self.observer = observers.current()  # an instrument's (bench, the contract): None by default
        self.heal, self._losses = parts.heal, []  # --heal: a step's losses count once it commits
        if self.heal is not None:
            self.optimizer = CommitGate(trained.optimizer, self.heal)
        self._marked_at = 0  # the step the step timer was last marked at (a log point read late)
        self.done = self.position.step >= plan.total_steps
        self.epochs_driven = False  # epochs() drives steps(); else the run is counted in steps alone
        # What set-up made (torch's and the libraries' modules, the model, the data) lives as long as the run: out
        # of the collector's generations, each collection during training walks only what the steps make. Without
        # this, the collections that the steps' allocations trigger walked every object of the imports too.
        gc.collect()
        gc.freeze()
        log.info(
            "run directory %s; %d process(es), backend %s/%s, global batch %d, %d steps (%d per epoch, loss every %d)",
            self.checkpointer.run.dir,
            ctx.world_size,
            ctx.backend,
            ctx.device.type,
            plan.samples_per_step,
            plan.total_steps,
            plan.steps_per_epoch,
            self.metrics.every,
        )
        self._run_pending()  # a --heal replacement that joined its peers in a pause runs it with them

    def _run_pending(self) -> None:
        """The pause --heal's peers run again (their state said which), run here too."""
        pending = self.heal.pending if self.heal is not None else None
        if pending is not None:
            self.done = self.heal.retrying(functools.partial(self._after, *pending), pending, again=True).last
            self.heal.pending = None

    # ------------------------------------------------------------------------------------ for the experiment

    @property
    def global_step(self) -> int:
        """Optimizer steps done, counting those before a resume."""
        return self.position.step

    @property
    def writer(self) -> RankZeroWriter:
        """The run's TensorBoard writer (rank 0 writes; the other ranks' calls do nothing)."""
        return self.metrics.writer

    @property
    def last_evaluation(self) -> Any:
        """What the plan's evaluation returned last, as it returned it (None before the first)."""
        return self.metrics.last_evaluation

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
            if self.heal is not None:
                seed_rank_streams(self.heal.seed, self.ctx.rank, self.position.step)  # a replacement draws the same
            for first in batches:
                if self.heal is None:
                    yield self._micro_batches(first, batches)
                    continue
                held = [first, *itertools.islice(batches, self.plan.grad_accum - 1)]  # a retry trains on them again
                drawn = get_rng_state()  # and draws what the first attempt drew
                while True:
                    self.heal.begin()  # the quorum: a replacement joins here
                    received = self.heal.received  # the others committed this step: this rank took their state
                    if received or self.heal.pending is not None:
                        self._run_pending()  # a pause a rank failed in: run again by all
                        if received:
                            break
                        continue
                    set_rng_state(drawn)
                    yield self._micro_batches(held[0], iter(held[1:]))
                    if self.heal.committed:
                        break
                seed_rank_streams(self.heal.seed, self.ctx.rank, self.position.step)  # for the next batch's draws

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
        initial, desc = total - remaining * plan.grad_accum, f"epoch {position.epoch + 1}"
        bar = self.metrics.progress(loader, total=total, initial=initial, desc=desc)
        batches = (batch for _, batch in zip(range(remaining * plan.grad_accum), bar))
        replay, self._replay_next = self._replay_next, None  # a resume's first step: run, undone, run again
        stream = replay.batches(batches, plan.grad_accum) if replay is not None else batches
        try:
            for batch in stream:
                if not self.replaying:
                    self.profiler.begin_step(position.step + 1)
                if self.observer is not None and not self.replaying:
                    self.observer.batch(position.step + 1, batch)
                yield batch
        finally:
            bar.close()

    @property
    def replaying(self) -> bool:
        return self.replay is not None and self.replay.active

    def backward(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (the mean over its samples): watched by the non-finite guard and added to the log
        interval's mean (one kernel each, no host read), divided by --grad-accum (the step's gradient is the mean
        over its micro-batches), scaled by the GradScaler given to ``resume_or_start`` (fp16: small gradients do not
        underflow), and back-propagated."""
        if self.heal is not None:
            self._losses.append(self.heal.average(loss))
        elif not self.replaying:  # the resume's settling pass counts nothing
            self._observe(loss)
        if self.plan.grad_accum > 1:
            loss = loss / self.plan.grad_accum
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _observe(self, loss: torch.Tensor) -> None:
        self.stops.observe(loss, self.position.step + 1)
        self.metrics.observe(loss)

    def step(self, lr: float | None = None) -> bool:
        """After each optimizer step (the module docstring says what it does, in which order). Returns True when
        the loop over ``steps()`` must end: the epoch, the run, or a stop. ``lr``: the step's learning rate, for
        the curves (default: the optimizer's first group's)."""
        if self.replaying:
            return False  # the resume's first step, run once to settle DDP's buckets and undone: it counts nothing
        if self.heal is not None:
            losses, self._losses = self._losses, []
            if not self.heal.commit():
                self.heal.put_back()
                return False  # a peer died in this step: abandoned on every rank, its batches handed out again
            for loss in losses:
                self._observe(loss)
        epoch = self.position.epoch  # the epoch this step trained in
        epoch_done = self.position.advance()
        self.metrics.count_step()
        step = self.position.step
        heartbeat.beat(step)  # the step a killed rank had reached, for its launcher's report
        lr = self.optimizer.param_groups[0]["lr"] if lr is None else lr
        after = functools.partial(self._after, step, epoch, epoch_done, lr)
        due = after() if self.heal is None else self.heal.retrying(after, (step, epoch, epoch_done, lr))
        self.profiler.end_step(step, last=due.last)
        self.timer.start_step()
        self.done = due.last
        if step == self.position.start + 1:  # set-up is over on every rank: from here on a wait this long is a hang
            if self.observer is not None:
                self.observer.mark("first_step", step=step)
            set_collective_timeout(self.collective_timeout_s)
        return self.done or epoch_done

    def _after(self, step: int, epoch: int, epoch_done: bool, lr: float) -> Due:
        """What falls due after ``step``, and its pause (under --heal, one a peer died in runs again)."""
        due = self._due(step, epoch_done, lr)
        self.timer.end_step()
        if self.metrics.warmup_ends(step, epoch_done=epoch_done):
            self.metrics.end_warmup()
        if due.pauses:
            self._pause(step, epoch, lr, due)
        elif due.log:  # read late: queued behind the step's kernels, nothing waits for the GPU here
            self._send_late(step, epoch, lr)
        return due

    def _due(self, step: int, epoch_done: bool, lr: float) -> Due:
        """What falls due after ``step``: each component's cadence, then whether the run stops here (a log point
        read late may tell of a signal; asking the ranks is a collective, made where the loop pauses anyway, or
        on CPU at every step read at once)."""
        end = step >= self.plan.total_steps
        epoch_end = self.plan.per_epoch and epoch_done
        stop = not end and self.stops.stop_planned(step)  # --stop-at-step
        save = stop or self.checkpointer.due(step, last=end, epoch_end=epoch_end)
        evaluate = self.metrics.evaluation_due(step, last=end, epoch_end=epoch_end)
        replicas = self.stops.replicas_due(step, saving=save)
        log = self.metrics.log_due(step) or end  # the end: metrics.json's final loss is its interval's
        due = Due(end, epoch_end, log, self.late is None, evaluate, save, replicas, stop)
        # read late: the last log point's figures, at the next one or before a pause (a checkpoint is written only
        # after the guard's verdict on every step before it)
        signalled = self.late is not None and (due.log or due.pauses) and self._receive_late(step, lr)
        # (not under --heal: a collective after each committed step is one more place a fault lands outside the step)
        ask = due.pauses or (due.read_now and self.ctx.device.type == "cpu" and self.heal is None)
        # asking waits for the slowest rank: comm wait (not asking waits on nobody; on CUDA a mark is an event)
        with self.timer.waiting() if ask else contextlib.nullcontext():
            stopping = not end and self.stops.stops_at(step, ask_signals=ask, signalled=signalled)
        if stopping == stop:
            return due
        return replace(due, stop=True, save=True, replicas=self.stops.replicas_due(step, saving=True))

    def _pause(self, step: int, epoch: int, lr: float, due: Due) -> None:
        """The step's pause, its clock stopped (marked in a --profile trace): the guard's verdict and the replica
        check, the log point read at once (if one is due), the evaluation, the checkpoint, the epoch's line."""
        self.metrics.pause_clock()
        with record_function(PAUSE_ANNOTATION):
            if due.epoch_end and self.observer is not None:
                self.observer.epoch_trained(epoch + 1)  # bench.step_overhead's pause, where it asks for one
            weights = self.model if due.save or due.evaluate else None
            self.stops.check(step, weights, due.replicas, self.checkpointer.kept, lr)
            if due.log:  # a checkpoint, an evaluation or a replica check adds no point: the interval goes on
                self.metrics.log_train(step, epoch, lr)
            elif due.save:  # the checkpoint holds the interval so far: a resume continues it
                self.metrics.carry_interval()
            if due.evaluate:
                self.metrics.evaluate(step)
            if due.save:
                began = time.perf_counter()
                self.checkpointer.save(step)
                self.metrics.checkpoint_stalled(time.perf_counter() - began)
                if due.last:  # the run ends here: its last checkpoint on disk (written in the background)
                    self.checkpointer.wait()
            if due.epoch_end:
                self.metrics.log_epoch(step, self.position.epoch)
        self.metrics.resume_clock()

    def _send_late(self, step: int, epoch: int, lr: float) -> None:
        """The log point's figures, queued (``late_reads.py``): the guard's verdict and this rank's signal flag, the
        interval's loss sum and count, the step times up to the last log point (their events have completed)."""
        point = LogPoint()
        self.stops.fill(point)
        self.metrics.fill(point, marked=True)
        times_step, self._marked_at = self._marked_at, step
        self.timer.mark()  # the steps up to this one: the next log point's to read
        assert self.late is not None
        self.late.send(Sent(step, epoch, lr, times_step), *point.pack())

    def _receive_late(self, step: int, lr: float) -> bool:
        """The last log point's figures, every rank's: a divergence raised now on every rank (``step``: where it
        stopped), the line logged under its own step. Returns whether any rank got a stop signal."""
        assert self.late is not None
        received = self.late.receive()
        if received is None:
            return False
        sent, table = received
        rows = [LogRow.unpack(row, with_verdict=True) for row in table]
        signalled = self.stops.judge_late(rows, step, self.checkpointer.kept, lr)
        self.metrics.record_train(sent.step, sent.epoch, sent.lr, rows, times_step=sent.times_step)
        return signalled

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
            self.metrics.close()
            self.stops.report(step, self.checkpointer.run.dir, self.plan.total_steps)
            return {"steps": step, "stopped_early": True}
        return self.metrics.finish(step, self.ctx.world_size, extra)
