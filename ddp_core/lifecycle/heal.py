"""``--heal``, a worker's side (docs/faults.md): a dead worker's replacement receives the run's state from a live
peer; the survivors keep their processes, models, optimizers and data positions.

On torchft: each worker is a replica group of its own; the quorum, at each step's start, needs the whole world (no
step commits with a rank missing); a replacement joins there. The step's all-reduces go through torchft's manager and
the step commits before the optimizer steps, only where all succeeded: else it is retried on the same batches, with
random streams drawn again from (seed, rank, step). The run's own collectives use torch's default group, formed again
per quorum; a pause a peer died in runs again once the group is whole, by the replacement too.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ddp_core import observers
from ddp_core.distributed import flight_recorder, sync_batchnorm
from ddp_core.distributed.collectives import all_gather_object
from ddp_core.distributed.group import DistContext, regroup
from ddp_core.lifecycle.checkpointer import Checkpointer
from ddp_core.lifecycle.metrics_log import MetricsLog
from ddp_core.lifecycle.states import Kind, Named, load_copy
from ddp_core.ranks import THIS_RANK, on_rank0

T = TypeVar("T")
log = logging.getLogger(__name__)
Pending = tuple[int, int, bool, float]  # a pause to run again: (step, epoch, epoch_done, lr), loop.py's


class Healer:
    """One worker's torchft manager, and the step's commit. A replacement receives the checkpointer's replicated
    states (the model, the optimizer, the position, the scaler, the metrics, what the run tracks)."""

    def __init__(self, ctx: DistContext, seed: int, timeout_s: float) -> None:
        import torchft  # an optional extra: imported under --heal only

        warnings.filterwarnings("ignore", "The given buffer is not writable")  # torch, reading a peer's state
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):  # every quorum, commit and
            logging.getLogger(name).setLevel(logging.CRITICAL)  # failed all-reduce: the run says what happened
        self.ctx, self.seed, self.checkpointer = ctx, seed, None
        timeout = timedelta(seconds=timeout_s)
        self.pg = torchft.ProcessGroupNCCL(timeout) if ctx.backend == "nccl" else torchft.ProcessGroupGloo(timeout)
        # the replica group's own store: one process, on this host
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # torchft would move NCCL's flight-recorder dumps to a folder per quorum: they stay where the report looks
        dump_to = os.environ.pop(flight_recorder.DUMP_VARIABLE, None)
        self.manager = torchft.Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ctx.world_size,  # no step commits with a rank missing: bitwise with a fault-free run
            use_async_quorum=False,  # the state arrives before the forward pass
            init_sync=False,  # every rank starts from the same seed or checkpoint
            replica_id=f"rank{ctx.rank:05d}",  # zero-padded: the quorum orders replicas as the ranks
            store_addr="127.0.0.1",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            timeout=timeout,
            quorum_timeout=timeout,
        )
        if dump_to is not None:
            os.environ[flight_recorder.DUMP_VARIABLE] = dump_to
        self.pending: Pending | None = None  # a pause a peer died in, run again by every rank
        self.committed, self._decided, self._skip_quorum, self.received = True, False, False, False
        self._quorum = -1  # the quorum the default group was formed for
        sync_batchnorm.on_failure = self.failed
        self._averaging: list[Any] = []  # the step's losses in flight (``average``)
        self.metrics: MetricsLog | None = None
        self._interval: tuple[float, int] | None = None  # a peer's log interval, received
        self.before: tuple[float, int] = (0.0, 0)  # the log interval as the last pause began

    def wrap(self, model: nn.Module, **options: Any) -> nn.Module:
        """``model`` in torchft's DDP (torch's, with DDP's ``options``): its gradients averaged through the manager."""
        import torchft

        return torchft.DistributedDataParallel(self.manager, model, **options)

    def attach(self, checkpointer: Checkpointer, step: int) -> None:
        """The run's states, as resumed or started at ``step``: what a replacement receives. Again once resumed."""
        self.checkpointer = checkpointer
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.ctx.world_size})

    def attach_metrics(self, metrics: MetricsLog) -> None:
        """The metrics log (made after a replacement joined): the log interval so far travels with the state."""
        self.metrics = metrics
        if self._interval is not None:
            metrics.set_interval(*self._interval)

    def join(self) -> None:
        """A replacement, before its loop: the quorum with the survivors, and the state from one of them (none where
        every worker was replaced: the run's checkpoint, then). Where they were at a step's start, this quorum is that
        step's; where they were in a pause, the pause runs here next."""
        self._quorum_now()
        step = self.manager.current_step()
        if self.received:
            observers.mark("healed", step=step)  # bench.recovery: the state arrived
            log.warning(
                "rank %d replaces a dead worker: its state at step %d from a peer", self.ctx.rank, step, extra=THIS_RANK
            )
        self._skip_quorum = self.pending is None

    def begin(self) -> None:
        """A step's start (each retry's too): the quorum, unless a replacement's join was it."""
        if self._skip_quorum:
            self.received = False  # a replacement's first batches are its own
        else:
            self._quorum_now()
        self._skip_quorum, self._decided = False, False
        assert self.checkpointer is not None
        self._buffers = [buffer.clone() for buffer in self.checkpointer.model.buffers()]  # batch norm's statistics

    def failed(self, error: Exception) -> None:
        """A collective of the default group failed inside the step (a peer died): the step is abandoned, and the
        group closed at once, so that the others' and this step's later collectives fail fast."""
        self.manager.report_error(error)
        close_the_group()

    def average(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` averaged over the ranks once the step commits, part of the step: a log point's mean stays exact
        where a rank's own sums died with it."""
        averaged = loss.detach().clone()
        self._averaging.append(self.manager.allreduce(averaged))
        return averaged

    def commit(self) -> bool:
        """Before the optimizer steps: whether every rank's all-reduce of this step succeeded (decided once)."""
        if not self._decided:
            for work in self._averaging:
                work.wait()  # a failure is the manager's to note
            self._averaging.clear()
            if self.manager.errored() is not None:
                self.pg.abort()  # at once: a survivor waiting on this one would wait out the timeout
            self.committed, self._decided = self.manager.should_commit(), True
            if not self.committed:  # what the experiment updates after the optimizer (an EMA) is put back in step()
                self._kept = {named.name: copy.deepcopy(named.part.state_dict()) for named in self._after_optimizer()}
                step = self.manager.current_step() + 1
                observers.mark("abandoned", step=step)  # bench.recovery: a failure seen
                said(f"step {step}: a worker died in it; it runs again once replaced")
        return self.committed

    @torch.no_grad()
    def put_back(self) -> None:
        """An abandoned step's updates undone: the model's buffers (batch norm's statistics), and what follows the
        optimizer (an EMA's, a scaler's)."""
        for kept, buffer in zip(self._buffers, self.checkpointer.model.buffers()):
            buffer.copy_(kept)
        for named in self._after_optimizer():
            load_copy(named.part, self._kept[named.name])

    def _after_optimizer(self) -> list[Named]:
        assert self.checkpointer is not None
        return [n for n in self.checkpointer.states.of(Kind.REPLICATED) if n.tracked or n.name == "grad_scaler"]

    def retrying(self, work: Callable[[], T], pending: Pending, again: bool = False) -> T:
        """``work`` (a pause's collectives), run again once the group is whole where a peer died in it (``again``:
        run again now), each time from the log interval it began with (a log point resets it)."""
        assert self.metrics is not None
        if not again:
            self.before = self.metrics.interval()
        while True:
            try:
                if again:
                    self.metrics.set_interval(*self.before)
                again = True
                return work()
            except RuntimeError:  # gloo's "connection closed by peer", a DistError, a timeout
                before, self.pending = self._quorum, pending  # what a replacement runs with the survivors
                observers.mark("abandoned", step=pending[0], pause=True)
                said(f"step {pending[0]}: a worker died after it; its pause runs again once replaced")
                close_the_group()
                self._quorum_now()  # the replacement joins; the group forms again with it
                self.pending = None
                if self._quorum == before:
                    raise  # every rank is still there: not a peer's death

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def _quorum_now(self) -> None:
        self.received = False  # set by _load
        self.manager.start_quorum()
        error = self.manager.errored()
        if error is not None:
            raise RuntimeError(f"--heal: the quorum failed: {error}") from None
        quorum = self.manager._quorum_id  # torchft has no public accessor: the group is formed again per quorum
        if quorum != self._quorum:
            self._quorum = quorum
            regroup(self.ctx, f"ddp_lab/heal_{quorum}")
            # a pause a rank failed in (another may have finished it): every rank runs it again, together
            self.pending = next((each for each in all_gather_object(self.pending) if each is not None), None)

    def _state(self) -> dict[str, Any]:
        assert self.checkpointer is not None, "attach() before the first quorum"
        interval = self.metrics.interval() if self.metrics is not None else None
        states = self.checkpointer.replicated()
        return {"states": states, "pending": self.pending, "interval": interval, "before": self.before}

    def _load(self, received: dict[str, Any]) -> None:
        assert self.checkpointer is not None, "attach() before the first quorum"
        self.checkpointer.put_back(received["states"])
        self.pending, self._interval, self.received = received["pending"], received["interval"], True
        self.before = received["before"]


class CommitGate:
    """The optimizer a --heal run steps (``loop.optimizer``): the experiment's, stepped only in a step that commits;
    everything else is the experiment's optimizer's."""

    def __init__(self, inner: torch.optim.Optimizer, healer: Healer) -> None:
        self.inner, self.healer = inner, healer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        return self.inner.step(closure) if self.healer.commit() else None


def close_the_group() -> None:
    """The default group aborted (its connections closed: a peer waiting on this rank fails at once, instead of
    waiting out the timeout) and destroyed; it may be broken or gone already."""
    with contextlib.suppress(Exception):
        dist.group.WORLD.abort()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def said(line: str) -> None:
    """A fault, in one line on rank 0."""
    on_rank0(lambda: log.warning(line))
