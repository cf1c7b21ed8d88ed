"""Console and TensorBoard output that does not multiply by the number of ranks.

Keyed on the GLOBAL rank (``LOCAL_RANK == 0`` would print once per node). A log record shows off global rank 0
only if it is that rank's own: an ERROR, or ``extra=THIS_RANK`` (docs/decisions.md, "Printed once").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ddp_core.distributed.agreement import rank0_decides
from ddp_core.distributed.group import rank, world_size
from ddp_core.layout import EVENTS
from ddp_core.output.storage import StorageError, describe
from ddp_core.ranks import THIS_RANK, is_global_rank0

T = TypeVar("T")


def this_ranks_own(record: logging.LogRecord) -> bool:
    """A record shown on a rank other than global rank 0: an error, or a call marked ``extra=THIS_RANK``."""
    return record.levelno >= logging.ERROR or bool(getattr(record, next(iter(THIS_RANK)), False))


def torch_handlers() -> list[logging.Handler]:
    """The handlers torch._logging gives torch's loggers at import: they do not propagate to the root's."""
    return [
        handler
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger)
        for handler in logger.handlers
    ]


def setup_logging(level: int = logging.INFO) -> None:
    """Rank-prefixed console logging; off global rank 0 only ``this_ranks_own`` records, unless LOG_ALL_RANKS=1."""
    prefix = f"[rank {rank()}/{world_size()}]" if world_size() > 1 else "[rank 0]"
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    if not is_global_rank0() and os.environ.get("LOG_ALL_RANKS", "0") != "1":
        handler.addFilter(this_ranks_own)  # at every level: a rank's own INFO line too (its profile, say)
        for torchs in torch_handlers():
            torchs.addFilter(this_ranks_own)
    root.setLevel(level)


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only."""
    if is_global_rank0():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class _Plain:
    """What ``progress`` returns off rank 0 or off a terminal: the iterable, with a do-nothing ``set_postfix``."""

    def __init__(self, iterable: Iterable[T]):
        self.iterable = iterable

    def __iter__(self) -> Iterator[T]:
        return iter(self.iterable)

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", initial: int = 0) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal; elsewhere the bare iterable. Both have ``set_postfix``."""
    if not is_global_rank0() or not sys.stderr.isatty():
        return _Plain(iterable)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, initial=initial, dynamic_ncols=True, leave=False)


class RankZeroWriter:
    """A TensorBoard SummaryWriter on global rank 0 (one event file: torch's ``add_hparams`` would open a second);
    elsewhere it does nothing. A failed write never raises from ``add_*``: the first is kept (``poll``) and reported
    at ``close()`` or the next checkpoint; ``collective=True``: every rank's ``close()`` raises StorageError at once."""

    def __init__(
        self,
        log_dir: str | Path,
        enabled: bool | None = None,
        purge_step: int | None = None,
        collective: bool = False,
        intact: Callable[[], str | None] | None = None,
    ):
        self.enabled = is_global_rank0() if enabled is None else enabled
        self.log_dir, self.collective, self._intact = Path(log_dir), collective, intact
        self.failure: tuple[str, OSError] | None = None
        self._closed, self._writer = False, None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter  # imported on rank 0 only: it is slow to import

            _quiet_tensorboard_thread_errors()
            with self._keep_failure():
                self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    @contextlib.contextmanager
    def _keep_failure(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            if self.failure is None:  # the file: the error's, else the one TensorBoard's writer has open
                opened = getattr(getattr(self._writer, "file_writer", None), "event_writer", None)
                where = error.filename or getattr(opened, "_file_name", None) or self.log_dir / EVENTS
                self.failure = (str(where), error)
            # Stop writing (the run stops at the next check). Not closed: closing waits on the background
            # thread's queue, and a dead thread must not be waited on; its files are opened per write.
            self._writer = None

    def poll(self) -> tuple[str, OSError] | None:
        """Rank 0: flush, so that a write TensorBoard's thread failed shows now; the first failure (path, error)."""
        self._call("flush")
        return self.failure

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self._writer is not None:
            with self._keep_failure():
                getattr(self._writer, method)(*args, **kwargs)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._call("add_scalar", tag, value, step)

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.add_scalar(tag, value, step)

    def add_image(self, tag: str, image: Any, step: int = 0, dataformats: str = "CHW") -> None:
        self._call("add_image", tag, image, step, dataformats=dataformats)

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        self._call("add_text", tag, text, step)

    def add_hparams(self, hparams: dict[str, Any], metrics: dict[str, float], step: int = 0) -> None:
        """Hyper-parameters with their final metrics, in the same event file as the scalars."""
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        clean = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        experiment, start, end = hparams_summary(clean, metrics)
        with self._keep_failure():
            file_writer = self._writer._get_file_writer()
            for summary in (experiment, start, end):
                file_writer.add_summary(summary, step)
            for tag, value in metrics.items():
                self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.poll()

    def close_here(self) -> None:
        """Flush and close on this rank only, reporting nothing: for a process on its way out after a failure."""
        if self._closed:
            return
        self._closed = True
        self._call("close")
        self._writer = None

    def close(self) -> None:
        """Flush and close; then a write that failed stops the run (StorageError: on every rank if collective)."""
        if self._closed:
            return
        self.close_here()
        failure = self.failure and describe(*self.failure, self._intact() if self._intact is not None else None)

        def report() -> None:
            if failure is not None:
                raise StorageError(failure)

        if self.collective:
            rank0_decides(report)
        else:
            report()


@functools.cache  # installed once per process
def _quiet_tensorboard_thread_errors() -> None:
    """Silence the traceback TensorBoard's writer thread prints for an OSError: RankZeroWriter reports it once."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard layout: its traceback stays, the one-line report too
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        previous(args)

    threading.excepthook = hook
