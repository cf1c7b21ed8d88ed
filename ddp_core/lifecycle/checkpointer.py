"""The checkpointer: when the run saves, and a checkpoint as the run's named states, gathered and restored by name.

When: every ``--checkpoint-every`` optimizer steps, at each epoch's end where the plan evaluates per epoch,
and always at the run's last step and at an early stop (a signal, ``--stop-at-step``), so that ``--resume``
continues from there. What: every part with state, by name (``states.py``: the model, the optimizer, the
position, the random streams, the gradient scaler, the communication hook, the metrics, and what the experiment
tracks with ``run.track``), each as its owner's ``state_dict()`` gives it; the header records the experiment's
name and config (a resume checks it continues the same run). The files (atomic writes, the last K kept,
``last.pt``) are ``output/checkpoint.py``'s.

A resume puts every state back by name; a name the checkpoint lacks, or one this run does not have, is one line,
exit 2. Bitwise at the same world size (the first step replayed where DDP rebuilds its buckets:
``training/buckets.py``); at another (docs/decisions.md, "Resume") per-rank states start afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_core.config import option
from ddp_core.distributed.collectives import gather_object
from ddp_core.distributed.env import nnodes_range
from ddp_core.errors import AgreedConfigError
from ddp_core.lifecycle.position import Position
from ddp_core.lifecycle.states import PROJECT_STATES, Kind, ModelState, Named, NamedStates, load_copy
from ddp_core.output.checkpoint import check_format, check_world_size, named_states
from ddp_core.output.run import RunDir
from ddp_core.training.amp import ScalerState
from ddp_core.training.buckets import FirstStepReplay, rebuilds_buckets
from ddp_core.training.comm import CommHook, ShardedOptimizerState
from ddp_core.training.seed import RankStreams

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


@dataclass(frozen=True)
class Trained:
    """What the experiment trains with: the checkpointer saves and restores it, the loop steps it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer  # under --zero: the ZeroRedundancyOptimizer
    scaler: torch.amp.GradScaler | None
    comm: CommHook


@dataclass(frozen=True)
class Recorded:
    """What each checkpoint records of the run beside its states, and how far a resume may stray from it."""

    experiment: str
    config: dict[str, Any]  # the run's options
    seed: int
    other_world: bool  # a resume may continue at another world size (--allow-config-change)


class Checkpointer:
    def __init__(
        self,
        run: RunDir,
        recorded: Recorded,
        options: CheckpointerArgs,
        trained: Trained,
        position: Position,
        tracked: Iterable[Named] = (),
        *,
        per_epoch: bool,
    ) -> None:
        self.run, self.experiment, self.config = run, recorded.experiment, recorded.config
        self.other_world = recorded.other_world
        model, optimizer, scaler, seed = trained.model, trained.optimizer, trained.scaler, recorded.seed
        self.model, self.comm, self.position = model, trained.comm, position
        self.every, self.per_epoch = options.checkpoint_every, per_epoch
        self.streams = RankStreams(seed, run.ctx.rank)
        self.scaler = ScalerState(scaler)
        self.states = NamedStates()
        self.states.add("model", ModelState(model))
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imported where used: it is slow

        if isinstance(optimizer, ZeroRedundancyOptimizer):  # --zero: each rank holds a share of the state
            self.states.add("optimizer", ShardedOptimizerState(optimizer), Kind.SHARDED)
        else:
            self.states.add("optimizer", optimizer)
        self.states.add("position", position)
        self.states.add("rng", self.streams, Kind.PER_RANK)
        self.states.add("grad_scaler", self.scaler)
        self.states.add("comm_hook", trained.comm, Kind.PER_RANK)  # PowerSGD's error feedback is each rank's own
        for named in tracked:
            self.states.add(named.name, named.part, named.kind, tracked=True)
        self._later: dict[str, Any] = {}  # a resume's states of the project's parts added after it (metrics)

    def add(self, name: str, part: Any) -> None:
        """A replicated part made after the resume (the metrics log): its state, if resumed, is loaded now."""
        self.states.add(name, part)
        if name in self._later:
            load_copy(part, self._later.pop(name))

    def replicated(self) -> dict[str, Any]:
        """The replicated states by name: what a --heal replacement receives from a peer."""
        return {named.name: named.part.state_dict() for named in self.states.of(Kind.REPLICATED)}

    def put_back(self, states: dict[str, Any]) -> None:
        """A peer's replicated states (``replicated``), by name; a part made later (the metrics log) gets its own
        when it is added."""
        for named in self.states.of(Kind.REPLICATED):
            load_copy(named.part, states[named.name])
        self._later = {name: state for name, state in states.items() if name not in self.states}

    def due(self, step: int, *, last: bool, epoch_end: bool) -> bool:
        """``last``: the run ends or stops at this step."""
        return last or (self.per_epoch and epoch_end) or bool(self.every and step % self.every == 0)

    def save(self, step: int) -> None:
        """Collective: every rank calls it at the same step; global rank 0 writes. One gather brings every rank's
        per-rank and sharded states to rank 0; replicated ones are rank 0's own."""
        parts = list(self.states)
        local = {named.name: named.part.state_dict() for named in parts if named.kind is not Kind.REPLICATED}
        by_rank = gather_object(local) if local else None

        def states() -> dict[str, Any]:  # rank 0, while it writes
            out = {}
            for named in parts:
                if named.kind is Kind.REPLICATED:
                    out[named.name] = named.part.state_dict()
                    continue
                assert by_rank is not None
                shares = [states[named.name] for states in by_rank]
                out[named.name] = shares if named.kind is Kind.PER_RANK else named.part.join(shares)
            return out

        about = {
            "experiment": self.experiment,
            "config": self.config,
            "per_rank": [named.name for named in parts if named.kind is Kind.PER_RANK],
        }
        self.run.save_checkpoint(step, states, about)

    def wait(self) -> None:
        """The checkpoint in flight on disk (written in the background): the run ends with its last one there."""
        self.run.checkpoints.wait()

    def kept(self) -> Path:
        """Collective, when a run stops on a fault: ``checkpoints/last.pt`` once the write in flight is on disk,
        so that the report names the checkpoint a resume really finds (a write that failed raises StorageError,
        as the next save would have)."""
        self.wait()
        return self.run.checkpoint_path

    def resume(self, world_size: int, rank: int, on_undo: Callable[[], None]) -> FirstStepReplay | None:
        """Collective: the checkpoint to continue (``--resume-from``'s file, else the newest that loads), every
        state put back by name. Returns the replay that settles DDP's buckets where the resume needs one; its undo
        then calls ``on_undo``."""
        checkpoint, path = self.run.load_checkpoint()
        check_format(checkpoint)
        written_world = checkpoint["world_size"]
        same_world = written_world == world_size
        if not (same_world or self.other_world or nnodes_range()):  # start_run checked it already
            check_world_size(written_world, world_size)
        self._check_names(named_states(checkpoint), path)
        self._check_shapes(checkpoint, path)
        self._restore(checkpoint, rank, same_world)
        self.scaler.warn = False  # a replay's undo loads the same states again
        position = self.position
        if not same_world:
            position.refit()
            # the old ranks' streams do not map onto the new ones, and must not replay the run's first draws
            self.streams.start(checkpoint["step"])
            self._warn_other_world(path, written_world, world_size, checkpoint["step"])  # warnings: rank 0's (the log)
            return None
        log.info("resumed %s at step %d", path, position.step)
        if not rebuilds_buckets(self.model, world_size, stateful_hook=self.comm.stateful):
            return None

        scaler = self.scaler.snapshot()  # as the resume left it: also where the checkpoint held no scaler state

        def undo() -> None:
            """Every state back to the checkpoint's (the random streams are the replay's own), the scaler to what
            it was before the step."""
            self._restore(checkpoint, rank, same_world=True)
            self.scaler.put_back(scaler)
            on_undo()

        return FirstStepReplay(self.model, undo=undo, first_pass=self.comm.plain)

    def _check_names(self, saved: dict[str, Any], path: Any) -> None:
        missing = [named.name for named in self.states if named.name not in saved]
        unexpected = [name for name in saved if name not in self.states and name not in PROJECT_STATES]
        if missing or unexpected:
            what = [f"no state named {', '.join(missing)}"] if missing else []
            what += [f"{', '.join(unexpected)}, which this run does not track"] if unexpected else []
            raise AgreedConfigError(
                f"--resume: {path} holds {' and '.join(what)}: track the same objects (run.track) as the run that "
                "wrote it, or start a new run"
            )

    def _check_shapes(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Every replicated state's tensors have the checkpoint's shapes, and the model its names, or one line naming
        the first that differs and the options changed (--allow-config-change): load_state_dict would fail on it
        with a long traceback, or, for an optimizer's state, at the first step."""
        for named in self.states.of(Kind.REPLICATED):
            now, saved = _tensors(named.part.state_dict(), named.name), _tensors(checkpoint[named.name], named.name)
            differ = [(key, f"[{_dims(saved[key])}]", f"[{_dims(now[key])}]") for key in now if key in saved]
            if named.name == "model":  # an optimizer's state is empty before its first step
                differ += [(key, "absent", "present") for key in now if key not in saved]
                differ += [(key, "present", "absent") for key in saved if key not in now]
            differ = [row for row in differ if row[1] != row[2]]
            if differ:
                key, was, becomes = differ[0]
                changes = [change for change in self.run.config_changes if change.startswith("-")]
                flags = ", ".join(change.split(":")[0] for change in changes)
                cause = (
                    f"{', '.join(changes)} changes the model's tensors; a resume cannot change them (drop {flags}, "
                    "or start a new run)"
                    if changes
                    else "this run's model is not the one that wrote the checkpoint: start a new run"
                )
                raise AgreedConfigError(f"--resume: {path}'s {key} is {was}, this run's {becomes}: {cause}")

    def _restore(self, checkpoint: dict[str, Any], rank: int, same_world: bool) -> None:
        for named in self.states:
            state = checkpoint[named.name]
            if named.kind is Kind.PER_RANK:
                if not same_world:
                    continue  # each rank keeps the state it started with (docs/decisions.md)
                state = state[rank]
            load_copy(named.part, state)
        later = [name for name in PROJECT_STATES if name in checkpoint and name not in self.states]
        self._later = {name: checkpoint[name] for name in later}

    def _warn_other_world(self, path: Any, written_world: int, world_size: int, step: int) -> None:
        if self.comm.stateful:
            log.warning("--comm-hook %s starts its error feedback afresh at this world size", self.comm.name)
        afresh = [named.name for named in self.states.of(Kind.PER_RANK) if named.tracked]
        elastic = nnodes_range()
        log.warning(
            "resuming %s, written by %d processes at step %d, with %d%s: epoch %d continues after the %d samples it "
            "trained on, with new random streams per rank%s; every sample is still seen once per epoch, but the "
            "continuation is not bitwise",
            path,
            written_world,
            step,
            world_size,
            f" (--nnodes={elastic}: the node range changed the world; recorded in manifest.json)"
            if elastic and not self.other_world
            else "",
            self.position.epoch + 1,
            self.position.consumed,
            f" and {', '.join(afresh)} afresh (tracked per rank)" if afresh else "",
        )


def _tensors(state: Any, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors in a state (nested dicts, lists and tuples) by their path: ``model.net1.weight``."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {path: t for key, value in items for path, t in _tensors(value, f"{prefix}.{key}").items()}


def _dims(tensor: torch.Tensor) -> str:
    return ", ".join(map(str, tensor.shape))
