"""The metrics log: what the run reports, from global rank 0, and when.

- the train loss of each log interval (``--log-every``), averaged over its steps and the ranks, with every rank's
  times (``rank_times.py``): read at once (``log_train``) or one interval later (``fill`` then ``record_train``:
  ``log_point.py``, ``late_reads.py``);
- the evaluation's metrics (``eval/NAME``), one line per epoch with its throughput (``bench.gpu_report`` reads it);
- at the end, metrics.json and TensorBoard's hparams (docs/configuration.md says what each holds).

Throughput counts the steady state's training steps only, pauses and the warm-up left out (docs/decisions.md,
"Throughput is the steady state's training steps").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ddp_core.config import option
from ddp_core.distributed.collectives import all_gather_tensors
from ddp_core.lifecycle.late_reads import LOG_READS
from ddp_core.lifecycle.log_point import LogPoint, LogRow, gather_now
from ddp_core.lifecycle.plan import Plan
from ddp_core.lifecycle.rank_times import RankTimes
from ddp_core.output.logging import progress
from ddp_core.output.run import RunDir
from ddp_core.ranks import on_rank0
from ddp_core.training.metrics import log_interval

log = logging.getLogger(__name__)


@dataclass
class MetricsLogArgs:
    """The metrics log's cadence: how often the run evaluates and logs the train loss."""

    eval_every: int = option(
        0,
        "evaluate every N optimizer steps, and at the run's end (0: only at the end, and at each epoch's end where "
        "the experiment evaluates per epoch)",
        minimum=0,
        computation=False,
    )
    log_every: int = option(
        0,
        "optimizer steps between train-loss points (console and TensorBoard), each the mean over its interval and "
        "the ranks (0: about ten an epoch)",
        minimum=0,
        computation=False,
    )
    log_reads: str = option(
        "auto",
        "when a log point reads the interval's figures back from the device (loss, non-finite check, stop signals, "
        "step times): late, at the next log point or pause, so that the host never waits for the GPU there; now, "
        "at the point itself; auto: late on CUDA",
        choices=LOG_READS,
        computation=False,
    )


class MetricsLog:
    def __init__(
        self,
        run: RunDir,
        options: MetricsLogArgs,
        plan: Plan,
        device: torch.device,
        resumed_at: int | None,
        ranks: RankTimes,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run, self.plan, self.device, self.ranks = run, plan, device, ranks
        self.eval_every, self.config = options.eval_every, config or {}  # config: the run's, as TensorBoard's hparams
        self.every = log_interval(plan.steps_per_epoch, options.log_every)
        self.writer = run.open_writer(purge_step=resumed_at)  # a resume drops the events after its step
        self.train_loss = math.nan  # the mean loss of the last log interval, over every rank
        self.last_eval: dict[str, float] | None = None  # the last evaluation's metrics
        self.last_evaluation: Any = None  # what the experiment's evaluate() returned, as it returned it
        self.bar: Any = progress(())  # each pass over a loader replaces it
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._loss_count = 0
        self._carried: tuple[float, int] = (0.0, 0)  # the interval's loss sum and steps over every rank, to save
        self._trained_seconds, self._trained_steps = 0.0, 0  # this process's training steps, pauses left out
        self._warmup: tuple[int, float] | None = None  # (steps, seconds) when the warm-up ended
        self.eval_seconds = 0.0
        self.checkpoint_stalls_ms: list[float] = []  # each save's, as the loop waited for it
        self.restart_clocks()

    def state_dict(self) -> dict[str, float]:
        """The checkpoint's ``metrics`` state (the same on every rank): the last interval's train loss, and the
        interval so far over every rank (``carry_interval``), so that a resume goes on with the same interval."""
        total, steps = self._carried
        return {"train_loss": self.train_loss, "interval_loss_sum": total, "interval_steps": steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.train_loss = float(state["train_loss"])
        total, steps = float(state.get("interval_loss_sum", 0.0)), int(state.get("interval_steps", 0))
        if steps and on_rank0(lambda: True):  # once in the world: a log point sums every rank's share
            self._loss_sum.fill_(total)  # float64 sums of float32 losses are exact: the point is the same bits
            self._loss_count = steps

    def carry_interval(self) -> None:
        """Collective, where a checkpoint is saved between log points: the interval so far, summed over the ranks
        for the checkpoint; the interval itself goes on."""
        count = torch.tensor(float(self._loss_count), dtype=torch.float64).to(self.device)
        share = torch.stack([self._loss_sum, count])
        rows = [row[0].tolist() for row in all_gather_tensors([share])]
        self._carried = (sum(row[0] for row in rows), int(sum(row[1] for row in rows)))  # in rank order

    def log_due(self, step: int) -> bool:
        return step % self.every == 0

    def evaluation_due(self, step: int, *, last: bool, epoch_end: bool) -> bool:
        every = self.eval_every
        return self.plan.evaluate is not None and (last or epoch_end or bool(every and step % every == 0))

    def restart_clocks(self) -> None:
        """From now on: what was before (set-up, a resume's settling step) is not training time."""
        self._clock = time.perf_counter()
        self._epoch_seconds, self._epoch_steps = 0.0, 0
        self.ranks.restart()

    def begin_epoch(self) -> None:
        self._lap()  # the steps before are the last epoch's
        self._epoch_seconds, self._epoch_steps = 0.0, 0

    def count_step(self) -> None:
        self._epoch_steps += 1
        self._trained_steps += 1

    def warmup_ends(self, step: int, *, epoch_done: bool) -> bool:
        """Whether the warm-up ends with ``step``: the first epoch this process trains where the run has more,
        else its first log interval."""
        if self._warmup is not None:
            return False
        return epoch_done if self.plan.total_steps > self.plan.steps_per_epoch else self.log_due(step)

    def end_warmup(self) -> None:
        """After the step ``warmup_ends`` named: from here on the steps are the steady state."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # once a run: the warm-up's kernels are the warm-up's time
        self._lap()
        self._warmup = (self._trained_steps, self._trained_seconds)

    def pause_clock(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # where the loop synchronizes anyway: the time is the steps', not their launch's
        self._lap()

    def resume_clock(self) -> None:
        self._clock = time.perf_counter()

    def _lap(self) -> None:
        now = time.perf_counter()
        self._trained_seconds += now - self._clock
        self._epoch_seconds += now - self._clock
        self._clock = now

    def checkpoint_stalled(self, seconds: float) -> None:
        """How long the loop waited for a save (the write itself may go on in the background)."""
        self.checkpoint_stalls_ms.append(seconds * 1e3)

    def throughput(self) -> tuple[float, int]:
        """The steady state's samples per second, and the warm-up's steps left out of it (0: all steps counted)."""
        steps, seconds = self._trained_steps, self._trained_seconds
        warmup_steps = 0
        if self._warmup is not None and steps > self._warmup[0]:
            warmup_steps = self._warmup[0]
            steps, seconds = steps - warmup_steps, seconds - self._warmup[1]
        return steps * self.plan.samples_per_step / max(seconds, 1e-9), warmup_steps

    def interval(self) -> tuple[float, int]:
        """The log interval so far on this rank: its loss sum and steps (under --heal the same on every rank)."""
        return float(self._loss_sum), self._loss_count

    def set_interval(self, total: float, steps: int) -> None:
        """A --heal replacement's interval, a peer's."""
        self._loss_sum.fill_(total)
        self._loss_count = steps

    def observe(self, loss: torch.Tensor) -> None:
        self._loss_sum.add_(loss.detach())  # float64: one kernel, the loss converted exactly as it is added
        self._loss_count += 1

    def fill(self, point: LogPoint, marked: bool = False) -> None:
        """This rank's share of the log interval, which starts again: its loss sum on the device (float64, no host
        read), its loss count and its ``RankTimes`` row (``marked``: up to the step timer's last mark)."""
        point.loss_sum = self._loss_sum.clone()
        self._loss_sum.zero_()
        point.loss_count, self._loss_count = self._loss_count, 0
        self._carried = (0.0, 0)  # a new interval: nothing of it yet
        point.times = self.ranks.local(marked)

    def log_train(self, step: int, epoch: int, lr: float) -> None:
        """The interval's point now: one collective, its figures read on the host (a synchronization)."""
        point = LogPoint()
        self.fill(point)
        self.record_train(step, epoch, lr, gather_now(point))

    def record_train(self, step: int, epoch: int, lr: float, rows: list[LogRow], times_step: int | None = None) -> None:
        """Every rank's figures for the interval that ended at ``step``, in rank order: the mean loss over the
        ranks, their step times (ending at ``times_step``, else ``step``), the curve points, the console line."""
        count = sum(row.loss_count for row in rows)
        if count:
            self.train_loss = sum(row.loss_sum for row in rows) / count  # float64, summed in rank order
        self.ranks.record(step if times_step is None else times_step, [row.times for row in rows], self.writer)
        self.writer.add_scalars({"train/loss": self.train_loss, "train/lr": float(lr)}, step)
        log.info(
            "step %d/%d  epoch %d  loss %.5f  lr %.4g", step, self.plan.total_steps, epoch + 1, self.train_loss, lr
        )
        self.bar.set_postfix(loss=f"{self.train_loss:.3f}", lr=f"{lr:.3g}")

    def progress(self, loader: Iterable[Any], *, total: int, initial: int, desc: str) -> Any:
        """A pass over ``loader`` with a progress bar (rank 0 at a terminal) that shows the last loss."""
        self.bar = progress(loader, total=total, initial=initial, desc=desc)
        return self.bar

    def close(self) -> None:
        """A run stopped early: its curves written, no metrics.json."""
        self.writer.close()

    def evaluate(self, step: int) -> None:
        assert self.plan.evaluate is not None
        began = time.perf_counter()
        result = self.plan.evaluate(step, self.writer)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # its kernels are its time, not the next step's
        self.last_evaluation = result
        self.last_eval = result if isinstance(result, dict) else result.as_metrics()
        self.writer.add_scalars({f"eval/{name}": value for name, value in self.last_eval.items()}, step)
        # Its figures written now, not behind the next steps: TensorBoard's writer thread checksums each record
        # in pure Python while holding the GIL (about 30 ms per 100 KB), which stalled the steps that followed.
        self.writer.flush()
        self.eval_seconds += time.perf_counter() - began
        if not self.plan.per_epoch:
            log.info("step %d  %s", step, show_eval(self.last_eval))

    def log_epoch(self, step: int, epochs_done: int) -> None:
        """One line per epoch: its evaluation and the throughput of its training steps (called paused: the
        evaluation, the checkpoint and the log are not in it); the warm-up's epoch is marked."""
        plan = self.plan
        speed = self._epoch_steps * plan.samples_per_step / max(self._epoch_seconds, 1e-9)
        self.writer.add_scalar(f"train/{plan.unit}_per_s", speed, step)
        epochs, shown = plan.total_steps // plan.steps_per_epoch, show_eval(self.last_eval)
        warmup = " (warm-up)" if self._warmup is not None and self._warmup[0] == self._trained_steps else ""
        log.info("epoch %d/%d  step %d  %s  %.0f %s/s%s", epochs_done, epochs, step, shown, speed, plan.unit, warmup)

    def finish(
        self, step: int, world_size: int, extra: dict[str, Any] | Callable[[], dict[str, Any]] | None
    ) -> dict[str, Any]:
        """metrics.json (by rank 0; a failed write stops every rank) and TensorBoard's hparams; the writer closed."""
        plan = self.plan
        if plan.evaluate is not None and self.last_eval is None:  # resumed a finished run: evaluate once
            self.evaluate(step)
        evaluation = {f"eval_{name}": value for name, value in (self.last_eval or {}).items()}
        speed, warmup_steps = self.throughput()
        stalls = sorted(self.checkpoint_stalls_ms)
        metrics = {
            **evaluation,
            "final_loss": self.train_loss,
            "steps": step,
            "world_size": world_size,
            "global_batch_size": plan.samples_per_step,
            f"{plan.unit}_per_s": speed,
            "throughput_warmup_steps": warmup_steps,  # the steps left out of the throughput, not an lr warm-up
            "eval_seconds": self.eval_seconds,
            "checkpoint_stall_ms": stalls[(len(stalls) - 1) // 2] if stalls else 0.0,  # the median save's
            "checkpoint_stall_ms_max": stalls[-1] if stalls else 0.0,
            "checkpoints_saved": len(stalls),
            **self.ranks.summary(),
            **((extra() if callable(extra) else extra) or {}),
        }
        if torch.cuda.is_initialized():  # rank 0's GPU: ranks hold the same model and batch size
            metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        headline = evaluation or {"final_loss": self.train_loss}
        self.writer.add_hparams(self.config, {f"hparam/{name}": value for name, value in headline.items()}, step)
        self.writer.close()
        self.run.finish(metrics)
        shown = show_eval(self.last_eval) if self.last_eval else f"final loss {self.train_loss:.4f}"
        log.info("done after %d steps: %s; %s (view: make tensorboard)", step, shown, self.run.dir)
        return metrics


def show_eval(values: dict[str, float] | None) -> str:
    """``eval accuracy 0.9120  eval loss 0.4100  eval samples 10000``: counts as integers, the rest to 4 places."""
    return "  ".join(
        f"eval {name} {int(value) if float(value).is_integer() and abs(value) >= 1 else f'{value:.4f}'}"
        for name, value in (values or {}).items()
    )
