"""The metrics log: what the run reports, from global rank 0, and when.

- the train loss of each log interval (``--log-every``; 0: about ten points an epoch), averaged over its
  steps and over the ranks, with the learning rate: console and TensorBoard. Its one collective also gathers
  every rank's compute and comm-wait time and bytes sent (``rank_times.py``);
- the evaluation's metrics (``eval/NAME``) at ``--eval-every`` steps, at each epoch's end where the plan
  evaluates per epoch, and always at the run's end;
- one line per epoch with its throughput (``bench.gpu_report`` reads it);
- at the end, metrics.json (the last evaluation as ``eval_NAME``, the last train loss, the throughput of the
  steps this process trained, the per-rank times and bytes) and TensorBoard's hparams. manifest.json is
  ``output/run.py``'s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ddp_core.distributed.collectives import all_gather_tensors, comm_device
from ddp_core.lifecycle.plan import Plan
from ddp_core.lifecycle.rank_times import RankTimes
from ddp_core.output.checkpoint import CheckpointArgs
from ddp_core.output.logging import progress
from ddp_core.output.run import Run
from ddp_core.training.metrics import log_interval

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(
        self,
        run: Run,
        args: CheckpointArgs,
        plan: Plan,
        device: torch.device,
        resumed_at: int | None,
        ranks: RankTimes,
    ) -> None:
        self.run, self.args, self.plan, self.device, self.ranks = run, args, plan, device, ranks
        self.every = log_interval(plan.steps_per_epoch, args.log_every)
        self.writer = run.open_writer(purge_step=resumed_at)  # a resume drops the events after its step
        self.train_loss = math.nan  # the mean loss of the last log interval, over every rank
        self.last_eval: dict[str, float] | None = None  # the last evaluation's metrics
        self.last_evaluation: Any = None  # what the experiment's evaluate() returned, as it returned it
        self.bar: Any = progress(())  # each pass over a loader replaces it
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._loss_count = 0
        self._trained_seconds = 0.0
        self.restart_clocks()

    # ------------------------------------------------------------------------------------ cadence

    def log_due(self, step: int) -> bool:
        return step % self.every == 0

    def evaluation_due(self, step: int, *, last: bool, epoch_end: bool) -> bool:
        every = self.args.eval_every
        return self.plan.evaluate is not None and (last or epoch_end or bool(every and step % every == 0))

    # ------------------------------------------------------------------------------------ clocks

    def restart_clocks(self) -> None:
        """From now on: what was before (set-up, a resume's settling step) is not training time."""
        self._clock = self._epoch_clock = time.perf_counter()
        self._epoch_steps = 0
        self.ranks.restart()

    def begin_epoch(self) -> None:
        self._epoch_clock, self._epoch_steps = time.perf_counter(), 0

    def count_step(self) -> None:
        self._epoch_steps += 1

    def pause_clock(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # where the loop synchronizes anyway: the time is the steps', not their launch's
        self._trained_seconds += time.perf_counter() - self._clock

    def resume_clock(self) -> None:
        self._clock = time.perf_counter()

    # ------------------------------------------------------------------------------------ what is logged

    def observe(self, loss: torch.Tensor) -> None:
        self._loss_sum += loss.detach().double()
        self._loss_count += 1

    def log_train(self, step: int, epoch: int, lr: float) -> None:
        rows = self._gather()
        count = round(sum(row[1] for row in rows))
        if count:
            self.train_loss = sum(row[0] for row in rows) / count  # float64, summed in rank order
            self._loss_sum.zero_()
            self._loss_count = 0
        self.ranks.record(step, [row[2:] for row in rows], self.writer)
        self.writer.add_scalars({"train/loss": self.train_loss, "train/lr": float(lr)}, step)
        log.info(
            "step %d/%d  epoch %d  loss %.5f  lr %.4g", step, self.plan.total_steps, epoch + 1, self.train_loss, lr
        )
        self.bar.set_postfix(loss=f"{self.train_loss:.3f}", lr=f"{lr:.3g}")

    def _gather(self) -> list[list[float]]:
        """One collective per interval, on every rank: each rank's loss sum and count, then its ``RankTimes`` row."""
        own = torch.tensor([self._loss_count, *self.ranks.local()], dtype=torch.float64, device=self.device)
        local = torch.cat([self._loss_sum.reshape(1), own]).to(comm_device())
        return [tensors[0].tolist() for tensors in all_gather_tensors([local])]

    def evaluate(self, step: int) -> None:
        assert self.plan.evaluate is not None
        result = self.plan.evaluate()
        self.last_evaluation = result
        self.last_eval = result if isinstance(result, dict) else result.as_metrics()
        self.writer.add_scalars({f"eval/{name}": value for name, value in self.last_eval.items()}, step)
        if not self.plan.per_epoch:
            log.info("step %d  %s", step, show_eval(self.last_eval))

    def log_epoch(self, step: int, epochs_done: int) -> None:
        """One line per epoch: its evaluation and its training throughput."""
        plan = self.plan
        speed = self._epoch_steps * plan.samples_per_step / max(time.perf_counter() - self._epoch_clock, 1e-9)
        self.writer.add_scalar(f"train/{plan.unit}_per_s", speed, step)
        epochs = plan.total_steps // plan.steps_per_epoch
        log.info(
            "epoch %d/%d  step %d  %s  %.0f %s/s",
            epochs_done,
            epochs,
            step,
            show_eval(self.last_eval),
            speed,
            plan.unit,
        )

    def finish(
        self,
        step: int,
        steps_trained: int,
        world_size: int,
        extra: dict[str, Any] | Callable[[], dict[str, Any]] | None,
    ) -> dict[str, Any]:
        """metrics.json (by rank 0; a failed write stops every rank) and TensorBoard's hparams; the writer closed."""
        plan = self.plan
        if plan.evaluate is not None and self.last_eval is None:  # resumed a finished run: evaluate once
            self.evaluate(step)
        evaluation = {f"eval_{name}": value for name, value in (self.last_eval or {}).items()}
        metrics = {
            **evaluation,
            "final_loss": self.train_loss,
            "steps": step,
            "world_size": world_size,
            "global_batch_size": plan.samples_per_step,
            f"{plan.unit}_per_s": steps_trained * plan.samples_per_step / max(self._trained_seconds, 1e-9),
            **self.ranks.summary(),
            **((extra() if callable(extra) else extra) or {}),
        }
        if torch.cuda.is_initialized():  # rank 0's GPU: ranks hold the same model and batch size
            metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        headline = evaluation or {"final_loss": self.train_loss}
        self.writer.add_hparams(asdict(self.args), {f"hparam/{name}": value for name, value in headline.items()}, step)
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
