"""The checkpointer: when the run saves, what a checkpoint holds, and how a resume puts it back.

When: every ``--checkpoint-every`` optimizer steps, at each epoch's end where the plan evaluates per epoch,
and always at the run's last step and at an early stop (a signal, ``--stop-at-step``), so that ``--resume``
continues from there. What: the model, optimizer and gradient scaler, the position (``position.py``), every
rank's random streams, the experiment's name and config (a resume checks it continues the same run), and
the last train loss. The files (atomic writes, the last K kept, ``last.pt``) are ``output/checkpoint.py``'s.

A resume at the same world size is bitwise: where DDP will rebuild its gradient buckets, the first step runs
once more and is undone (``training/buckets.py``). At another world size (``--allow-config-change``, or a
restart of an elastic node range: ``--nnodes=MIN:MAX`` under c10d) each rank gets fresh random streams and the
epoch continues after the samples already trained on.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddp_core.config import option
from ddp_core.distributed.collectives import gather_object
from ddp_core.distributed.env import nnodes_range
from ddp_core.distributed.group import rank, world_size
from ddp_core.lifecycle.position import Position
from ddp_core.output.checkpoint import restore
from ddp_core.output.run import RunDir
from ddp_core.ranks import is_global_rank0
from ddp_core.training.amp import restore_scaler, scaler_state
from ddp_core.training.buckets import FirstStepReplay, rebuilds_buckets
from ddp_core.training.comm import CommHook
from ddp_core.training.seed import seed_rank_streams

log = logging.getLogger(__name__)


@dataclass
class CheckpointerArgs:
    """The checkpointer's cadence."""

    checkpoint_every: int = option(
        0,
        "write a checkpoint every N optimizer steps; one is always written at the run's end and at an early stop "
        "(0: no others, but at each epoch's end where the experiment evaluates per epoch)",
        minimum=0,
        computation=False,
    )


class Checkpointer:
    def __init__(
        self,
        run: RunDir,
        experiment: str,
        options: CheckpointerArgs,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        comm: CommHook,
        per_epoch: bool,
        *,
        seed: int,
        config: dict[str, Any],
        other_world: bool,
    ) -> None:
        """``config``: the run's options, recorded in each checkpoint; ``other_world``: a resume may continue at
        another world size (--allow-config-change, or an elastic node range)."""
        self.run, self.experiment, self.seed, self.config = run, experiment, seed, config
        self.model, self.optimizer, self.scaler, self.comm = model, optimizer, scaler, comm
        self.every, self.per_epoch, self.other_world = options.checkpoint_every, per_epoch, other_world

    def due(self, step: int, *, last: bool, epoch_end: bool) -> bool:
        """``last``: the run ends or stops at this step."""
        return last or (self.per_epoch and epoch_end) or bool(self.every and step % self.every == 0)

    def save(self, position: Position, train_loss: float) -> None:
        """Collective: every rank calls it at the same step; global rank 0 writes."""
        if hasattr(self.optimizer, "consolidate_state_dict"):  # --zero: every rank's shard, gathered on rank 0
            self.optimizer.consolidate_state_dict(to=0)
        hooks = gather_object(self.comm.state()) if self.comm.stateful else None  # each rank's own error feedback
        extra = {
            "train_loss": train_loss,
            "experiment": self.experiment,
            "config": self.config,
            **(scaler_state(self.scaler) if self.scaler is not None else {}),
            **({"comm_hook": hooks} if hooks is not None else {}),
        }
        state = position.state()
        try:
            self.run.save_checkpoint(
                self.model, self.optimizer, state["step"], state["epoch"], extra, state["epoch_samples"]
            )
        finally:
            if hasattr(self.optimizer, "_all_state_dicts"):
                # ZeRO keeps the gathered copies of the other ranks' shards until the next gathering: written,
                # they would hold on rank 0 as much memory as ZeRO saves it (measured by bench.comm).
                self.optimizer._all_state_dicts = []

    def resume(
        self, position: Position, world_size: int, rank: int, on_undo: Callable[[], None]
    ) -> FirstStepReplay | None:
        """Collective: the checkpoint to continue (``--resume-from``'s file, else the newest that loads) put back
        into the model, optimizer, scaler, ``position`` and this rank's random streams. Returns the replay that
        settles DDP's buckets where the resume needs one; its undo then calls ``on_undo``."""
        checkpoint, path = self.run.load_checkpoint()
        written_world = checkpoint["world_size"]
        self._restore(checkpoint)
        position.resume(checkpoint, same_world=written_world == world_size)
        if written_world != world_size:
            if self.comm.stateful and is_global_rank0():
                log.warning("--comm-hook %s starts its error feedback afresh at this world size", self.comm.name)
            # the old ranks' streams do not map onto the new ones, and must not replay the run's first draws
            seed_rank_streams(self.seed, rank, checkpoint["step"])
            if is_global_rank0():
                elastic = nnodes_range()
                log.warning(
                    "resuming %s, written by %d processes at step %d, with %d%s: epoch %d continues after the %d "
                    "samples it trained on, with new random streams per rank; every sample is still seen once per "
                    "epoch, but the continuation is not bitwise",
                    path,
                    written_world,
                    checkpoint["step"],
                    world_size,
                    f" (--nnodes={elastic}: the node range changed the world; recorded in manifest.json)"
                    if elastic and not self.other_world
                    else "",
                    position.epoch + 1,
                    position.consumed,
                )
            return None
        log.info("resumed %s at step %d", path, position.step)
        if not rebuilds_buckets(self.model, world_size, stateful_hook=self.comm.stateful):
            return None
        scaler_before = copy.deepcopy(self.scaler.state_dict()) if self.scaler is not None else None

        def undo() -> None:
            """Weights and optimizer back to the checkpoint's, the scaler to what it was before the step (also where
            the checkpoint held none)."""
            self._restore(checkpoint, warn=False)
            if self.scaler is not None and scaler_before is not None:
                self.scaler.load_state_dict(scaler_before)
            on_undo()

        return FirstStepReplay(self.model, undo=undo, first_pass=self.comm.plain)

    def _restore(self, checkpoint: dict[str, Any], warn: bool = True) -> None:
        # start_run checked it already
        restore(checkpoint, self.model, self.optimizer, other_world=self.other_world or nnodes_range() is not None)
        hooks = checkpoint.get("extra", {}).get("comm_hook")
        if hooks is not None and len(hooks) == world_size():
            self.comm.load(hooks[rank()], next(self.model.parameters()).device)
        else:  # none saved (another hook before), or the ranks' error feedback does not map onto this world's
            self.comm.reset()
        if self.scaler is not None:
            mismatch = restore_scaler(self.scaler, checkpoint.get("extra", {}))
            if mismatch and warn:
                log.warning("%s; this resume will not be exact", mismatch)
