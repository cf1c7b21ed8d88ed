"""Checkpoints: written atomically by global rank 0, read back with ``weights_only=True``.

A file is a header (``HEADER``) and the run's named states (lifecycle/states.py), each as its owner wrote it;
``checkpoint["model"]`` is the plain model's state dict. ``CheckpointDir`` keeps the last K as step files and
``last.pt`` (a hard link to the newest): a kill at any point leaves every complete checkpoint loadable."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from ddp_core.config import option
from ddp_core.distributed.agreement import rank0_decides
from ddp_core.distributed.group import world_size
from ddp_core.errors import ConfigError
from ddp_core.layout import CHECKPOINTS, KEEP, LAST, STEP_FILE, step_file_name
from ddp_core.output.background_write import WRITES
from ddp_core.output.storage import StorageError, describe, is_storage_error, os_error_in
from ddp_core.output.writer_process import PROCESS_WRITER
from ddp_core.ranks import on_rank0
from ddp_core.training.transfer import to_host

log = logging.getLogger(__name__)

# 3: a header and named states (2 held the parts at fixed keys, and an "extra" dict; 1 had no position within the
# epoch). Files of an earlier format are refused with one line (check_format), never continued from a guess.
FORMAT = "ddp-lab/3"
EARLIER_FORMATS = {
    "ddp-lab/1": "without the position within its epoch",
    "ddp-lab/2": "its states at fixed keys, before they were named",
}
AUTO, THREAD, PROCESS = "auto", "thread", "process"  # --checkpoint-writer
WRITERS = (AUTO, THREAD, PROCESS)
HEADER = ("format", "step", "world_size", "experiment", "config", "per_rank")  # the rest: named states
# link(2) errors that mean "this filesystem has no hard links here", not "you may not write": copy instead
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message says why (one line, exit code 2)."""


@dataclass
class CheckpointFileArgs:
    """The options of a run's checkpoint files: which one a run continues from, and how many it keeps."""

    resume: bool = option(
        False,
        "continue the run in --run-dir from its newest checkpoint, with the options the checkpoint recorded but "
        "those set here",
        computation=False,
    )
    keep_checkpoints: int = option(
        KEEP,
        "how many checkpoints to keep, as checkpoints/step_<step>.pt (last.pt names the newest); 0 keeps every one",
        minimum=0,
        note="0 keeps every one",
        computation=False,
    )
    checkpoint_async: bool = option(
        True,
        "write checkpoint files behind the training loop from a copy in host memory (--checkpoint-writer: by whom): "
        "training waits for the copy, not the disk (--no-checkpoint-async: it waits for the file)",
        computation=False,
    )
    checkpoint_writer: str = option(
        AUTO,
        "who writes a background checkpoint: a process of its own, or a thread of the training process, whose GIL "
        "torch.save then holds for part of the write (auto: a process on CUDA, a thread on CPU)",
        choices=WRITERS,
        computation=False,
    )
    resume_from: str = option(
        "",
        "continue from exactly this checkpoint file (implies --resume; the run directory is --run-dir, else the run "
        "holding the file)",
        computation=False,
    )
    allow_config_change: bool = option(
        False,
        "resume even though an option set here that changes the computation differs from the checkpoint's "
        "(a warning, and manifest.json records the change); never one that changes a tensor's shape",
        computation=False,
    )

    def check_resume_from(self) -> None:
        """--resume-from's file loads as a checkpoint (read on global rank 0 only), before any process starts."""
        path = self.resume_from
        try:
            if path:
                on_rank0(lambda: load_checkpoint(path))
        except CheckpointError as error:
            raise ConfigError(f"--resume-from={path}: {error}") from None


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Temp file, fsync, ``os.replace``: a kill mid-write leaves the previous file whole; failures raise the OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f".{path.name}.tmp-*"):  # from a save that was killed
        leftover.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # a directory that refuses the write may refuse this too: then no temp file
            tmp.unlink(missing_ok=True)
        cause = os_error_in(error)
        if cause is not None and cause is not error and is_storage_error(cause):
            raise cause from None
        raise
    _fsync_directory(path.parent)  # make the rename itself durable


def _fsync_directory(folder: Path) -> None:
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def checkpoint_file(step: int, states: dict[str, Any], about: dict[str, Any] | None = None) -> dict[str, Any]:
    """The header (``about``: experiment, config, per_rank) and ``states`` by name."""
    about = about or {}
    taken = sorted(set(states) & set(HEADER))
    if taken:
        raise ValueError(f"a state may not be named {', '.join(taken)}: the header's names")
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size(),
        "experiment": about.get("experiment"),
        "config": about.get("config"),
        "per_rank": list(about.get("per_rank", [])),
        **states,
    }


def check_format(checkpoint: dict[str, Any]) -> None:
    """A CheckpointError (one line) for a file of an earlier format or none of ddp-lab's."""
    written = checkpoint.get("format")
    if written in EARLIER_FORMATS:
        raise CheckpointError(
            f"written by an earlier ddp-lab (format {written}, {EARLIER_FORMATS[written]}): continue it with the "
            "version that wrote it, or start a new run"
        )
    if written != FORMAT:
        raise CheckpointError(f"not a ddp-lab checkpoint (format {written!r}, expected {FORMAT!r})")


def named_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The states a checkpoint holds, by name: everything but the header."""
    return {name: state for name, state in checkpoint.items() if name not in HEADER}


def _tensor_bytes(state: Any) -> int:
    """About what the file will take on disk: the bytes of every tensor in ``state``."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def checkpoint_writer(choice: str, device: torch.device) -> str:
    """--checkpoint-writer resolved: ``auto`` is a process on CUDA (a thread's torch.save holds the GIL the loop
    needs to launch kernels), a thread on CPU."""
    if choice != AUTO:
        return choice
    return PROCESS if device.type == "cuda" else THREAD


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class CheckpointDir:
    """A run's ``checkpoints/``: the newest ``keep`` step files (0: all) and ``last.pt``. Only global rank 0 touches
    them; ``save`` and ``load_for_resume`` are collectives."""

    def __init__(self, directory: str | Path, keep: int = KEEP, background: bool = False, writer: str = THREAD) -> None:
        self.dir, self.keep = Path(directory), keep
        self.background = background  # --checkpoint-async: files written behind the loop (background_write.py)
        self.writer = writer  # who writes behind the loop: a thread, or a process (writer_process.py)
        if background and writer == PROCESS:  # started now, it imports torch by the first save
            with contextlib.suppress(OSError):  # the first write tries again; its failure stops every rank
                on_rank0(PROCESS_WRITER.start)

    @classmethod
    def of_run(cls, run_dir: str | Path, **options: Any) -> CheckpointDir:
        """The checkpoints of the run in ``run_dir`` (``options``: ``__init__``'s keep, background and writer)."""
        return cls(Path(run_dir) / CHECKPOINTS, **options)

    @property
    def last(self) -> Path:
        return self.dir / LAST

    def path_for(self, step: int) -> Path:
        return self.dir / step_file_name(step)

    def complete(self) -> list[tuple[int, Path]]:
        """The step files, newest first: complete by construction (a save renames its file into place last)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        found = [(int(match.group(1)), self.dir / name) for name in names if (match := STEP_FILE.fullmatch(name))]
        return sorted(((step, path) for step, path in found if path.is_file()), reverse=True)

    def newest(self) -> Path | None:
        steps = self.complete()
        if steps:
            return steps[0][1]
        return self.last if self.last.is_file() else None

    def exists(self) -> bool:
        return self.newest() is not None

    def intact(self) -> str | None:
        """For error messages: which checkpoint a --resume would continue from (None: there is none)."""
        steps = self.complete()
        if steps:
            return f"the last checkpoint, step {steps[0][0]}, is intact: {steps[0][1]}"
        return f"the last checkpoint is intact: {self.last}" if self.last.is_file() else None

    def save(
        self,
        step: int,
        states: Callable[[], dict[str, Any]],
        about: dict[str, Any] | None = None,
        pending: Callable[[], tuple[str, OSError] | None] | None = None,
    ) -> Path:
        """Collective: write ``step_<step>.pt``, point ``last.pt`` at it, delete the oldest beyond ``keep``.
        ``pending``: an earlier write failure to stop every rank at once this checkpoint is written."""
        path = self.path_for(step)
        copied: list[dict[str, Any]] = []  # rank 0, in the background: the state to write once every rank agreed

        def write() -> None:
            WRITES.wait()  # one write at a time: the one in flight first, and its failure stops every rank here
            state = checkpoint_file(step, states(), about)
            if self.background:  # a copy: the steps that follow change the model, not what is written
                copied.append(PROCESS_WRITER.pack(state) if self.writer == PROCESS else to_host(state))
            else:
                self.write(path, state)
            if pending is not None and (earlier := pending()) is not None:
                if copied:
                    copied.clear()
                    self.write(path, state)  # this checkpoint on disk first; in the pause nothing has changed it
                raise StorageError(describe(earlier[0], earlier[1], self.intact()))

        rank0_decides(write)
        if copied:  # handed over last: the writer thread then takes the GIL from the loop, not from this save
            state = copied.pop()
            if self.writer == PROCESS:
                WRITES.start(lambda: PROCESS_WRITER.write(self.dir, self.keep, path, state))
            else:
                WRITES.start(lambda: self.write(path, state))
        return path

    def wait(self) -> None:
        """Collective: rank 0's checkpoint write in flight is on disk; one that failed raises StorageError."""
        rank0_decides(WRITES.wait)

    def write(self, path: Path, state: dict[str, Any]) -> None:
        """Not a collective: ``save``'s writes; a storage failure is a StorageError naming the intact checkpoint."""
        target = path  # what a failure names
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for pattern in (".step_*.pt.tmp-*", f".{LAST}.tmp-*"):  # left by a save that was killed
                for leftover in self.dir.glob(pattern):
                    leftover.unlink(missing_ok=True)
            atomic_write(path, lambda handle: torch.save(state, handle))  # complete from here on
            target = self.last
            self._point_last_at(path)
            target = self.dir  # the oldest go once last.pt names this one: a kill before leaves one too many
            for _, old in self.complete()[self.keep :] if self.keep > 0 else ():
                if old != path and not _same_file(old, self.last):
                    old.unlink(missing_ok=True)
        except OSError as error:
            if not is_storage_error(error):
                raise
            newest = self.newest()  # its size is the best estimate of the next one's (headers, alignment)
            needed = max(_tensor_bytes(state), newest.stat().st_size if newest is not None else 0)
            raise StorageError(describe(target, error, self.intact(), needed)) from None

    def _point_last_at(self, path: Path) -> None:
        """Replace last.pt atomically by a hard link to ``path`` (a copy where links are not supported)."""
        tmp = self.dir / f".{LAST}.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError as error:
            if error.errno not in _NO_HARD_LINKS:
                raise
            with open(path, "rb") as source:  # copied in chunks: a checkpoint may not fit in memory twice
                atomic_write(self.last, lambda handle: shutil.copyfileobj(source, handle))
            return
        try:
            os.replace(tmp, self.last)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_directory(self.dir)

    def load_for_resume(self, resume_from: str | Path | None = None) -> tuple[dict[str, Any], Path]:
        """Collective: rank 0 reads the checkpoint to continue from (``resume_from``, later ones then
        ``*.superseded``; else the newest that loads, a corrupt newer one ``*.corrupt``) and sends it to every rank."""

        def choose() -> tuple[str, dict[str, Any]]:
            WRITES.wait()  # a write of this process in flight: the newest checkpoint may be that one
            try:
                return self._choose(Path(resume_from) if resume_from else None)
            except OSError as error:
                if not is_storage_error(error):
                    raise
                raise StorageError(describe(error.filename or self.dir, error, self.intact())) from None

        path, checkpoint = rank0_decides(choose)
        return checkpoint, Path(path)

    def _choose(self, resume_from: Path | None) -> tuple[str, dict[str, Any]]:
        if resume_from is not None:
            try:
                checkpoint = load_checkpoint(resume_from)
            except CheckpointError as error:
                raise CheckpointError(f"--resume-from={resume_from}: {error}") from None
            self._set_aside(resume_from, checkpoint.get("step", 0), unusable=[], later_ones=True)
            return str(resume_from), checkpoint

        steps, unusable, chosen = self.complete(), [], None
        from_last = None  # last.pt that is no hard link of a step file: a copy, or a run from before step files
        if self.last.is_file() and not any(_same_file(self.last, path) for _, path in steps):
            try:
                from_last = load_checkpoint(self.last)
            except CheckpointError as error:
                unusable.append((self.last, str(error)))
        for step, path in steps:
            if from_last is not None and step <= from_last.get("step", -1):
                break
            try:
                chosen = (path, load_checkpoint(path))
                break
            except CheckpointError as error:
                unusable.append((path, str(error)))
        if chosen is None and from_last is not None:
            chosen = (self.last, from_last)
        if chosen is None:
            if not unusable:
                raise CheckpointError(
                    f"--resume: no checkpoint in {self.dir}: start without --resume, or point --run-dir at the run to "
                    "continue"
                )
            raise CheckpointError(
                f"--resume: no checkpoint in {self.dir} loads: {'; '.join(why for _, why in unusable)}: "
                "start without --resume, or --resume-from a copy you trust"
            )
        path, checkpoint = chosen
        if unusable:
            log.warning(
                "%s: resuming from the previous checkpoint instead, %s (step %s); the unusable file is kept as %s",
                "; ".join(why for _, why in unusable),
                path,
                checkpoint.get("step"),
                ", ".join(f"{bad.name}.corrupt" for bad, _ in unusable),
            )
        self._set_aside(path, checkpoint.get("step", 0), unusable=[bad for bad, _ in unusable], later_ones=False)
        return str(path), checkpoint

    def _set_aside(self, chosen: Path, step: int, unusable: list[Path], later_ones: bool) -> None:
        """Rename what a later --resume must not pick over ``chosen``; point last.pt at ``chosen``."""
        moved = [bad.replace(bad.with_name(bad.name + ".corrupt")) for bad in unusable]
        if later_ones:
            later = [path for s, path in self.complete() if s > step and not _same_file(path, chosen)]
            moved += [path.replace(path.with_name(path.name + ".superseded")) for path in later]
            if later:
                log.warning(
                    "continuing from step %s: the %d later checkpoint(s) of this run are kept as %s and no longer "
                    "resumed from",
                    step,
                    len(later),
                    ", ".join(f"{path.name}.superseded" for path in later),
                )
        if chosen.parent.resolve() == self.dir.resolve() and STEP_FILE.fullmatch(chosen.name):
            if not _same_file(self.last, chosen):
                self._point_last_at(chosen)
        elif self.last.is_file() and any(_same_file(self.last, path) for path in moved):
            self.last.unlink()  # it named a checkpoint that is set aside; the next save writes it again
        if moved:
            _fsync_directory(self.dir)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with ``weights_only=True``: tensors and plain types only, so a crafted file cannot run code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if path.stat().st_size < len(b"PK\x03\x04"):  # less than a zip header: read as a (broken) raw pickle
            raise CheckpointError(f"{path} is truncated or corrupt (only {path.stat().st_size} bytes)") from error
        raise CheckpointError(
            f"{path} was refused by the weights-only loader: it holds more than tensors and plain types; "
            "only load files you trust, and never with weights_only=False"
        ) from error
    except (EOFError, RuntimeError, OSError) as error:
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(error)})") from error


def _first_line(error: BaseException) -> str:
    """The first sentence: torch's zip reader adds a paragraph of advice after it."""
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(error).__name__


def check_world_size(written_by: Any, now: int) -> None:
    """An exact resume needs the checkpoint's world size: data shards and RNG streams depend on it."""
    if written_by != now:
        raise ConfigError(
            f"the checkpoint was written by {written_by} processes and this run has {now}: "
            f"resume with --nproc-per-node/--nnodes giving WORLD_SIZE={written_by}, or pass --allow-config-change "
            "to continue at this size (not bitwise)"
        )


@dataclass(frozen=True)
class Written:
    """What a checkpoint says about the run that wrote it."""

    world_size: int
    experiment: str | None  # None: written before checkpoints recorded it
    config: dict[str, Any] | None


def written_by(path: Path) -> Written | None:
    """The world size, experiment and config of a checkpoint file (its tensors not loaded); None if it does not load."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        about = checkpoint.get("extra") or checkpoint  # format 2 kept them in "extra" (its resume is refused later)
        return Written(int(checkpoint["world_size"]), about.get("experiment"), about.get("config"))
    except Exception:
        return None
