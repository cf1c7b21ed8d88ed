"""Failures a user can act on, each one line with its own exit code: ``ConfigError`` (exit 2, printed once by
whoever its kind says) and ``RunStoppedError`` (raised by every rank at once, printed by global rank 0).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Callable, TypeVar

from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.ranks import is_global_rank0, is_local_rank0

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem the user can fix; one line, exit code 2, printed by the rank that raised it, or
    once per node (``node_wide``) or once by global rank 0 (``agreed``)."""

    agreed = False
    node_wide = False


class NodeConfigError(ConfigError):
    """A configuration problem of a whole node (its network): only the node's local rank 0 prints it."""


class AgreedConfigError(ConfigError):
    """A configuration problem every rank raised together (rank 0 decided): printed once, by global rank 0."""

    agreed = True


def _after_rank0_said_it() -> None:
    """Meet once more before leaving: a rank that exits first makes torchrun SIGTERM the others, and rank 0 could
    be ended before its line was out."""
    dist = sys.modules.get("torch.distributed")  # imported by whoever made the group; never imported here
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    with contextlib.suppress(Exception):  # the exit code still says what happened: the line is out, or the rank gone
        dist.barrier()


PEERS_CLOSE_WITHIN_S = 30.0  # how long a rank that leaves the line to its local rank 0 waits to be closed


@contextlib.contextmanager
def alike_on_the_node() -> Iterator[None]:
    """Around what every process of a node reads alike (flags, environment, files): a ConfigError raised inside is
    printed by the node's local rank 0 only. Not for what one rank reads alone (its RANK, its GPU)."""
    try:
        yield
    except ConfigError as error:
        if not error.agreed:
            error.node_wide = True
        raise


def _processes_on_this_node() -> int:
    """LOCAL_WORLD_SIZE (else WORLD_SIZE: a launch by hand, every process on one node), 1 when unset or not a number."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip() or os.environ.get("WORLD_SIZE", "").strip()
    try:
        return int(raw or 1)
    except ValueError:
        return 1


def _closed_by_the_launcher(timeout_s: float) -> bool:
    """Wait until the launcher closes this process (SIGTERM, or SIGINT), at most ``timeout_s``: True if it did.
    Leaving first would make torchrun close local rank 0 before it printed the node's line."""
    if threading.current_thread() is not threading.main_thread():
        return False  # a signal may go to any thread that does not block it: only the main thread can wait for one
    stops = {signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        return signal.sigtimedwait(stops, timeout_s) is not None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _shown_here(error: ConfigError) -> bool:
    """Whether this process prints ``error``'s line (its class says who: ConfigError's docstring)."""
    if error.agreed:
        return is_global_rank0()
    if isinstance(error, NodeConfigError):
        return is_local_rank0()
    if not error.node_wide or _processes_on_this_node() < 2 or is_local_rank0() or is_global_rank0():
        return True
    # Local rank 0 read the same flags and environment, raised the same line and prints it; the launcher then closes
    # this process. If it does not within PEERS_CLOSE_WITHIN_S, local rank 0 did not fail so: say it here.
    return not _closed_by_the_launcher(PEERS_CLOSE_WITHIN_S)


class RunStoppedError(RuntimeError):
    """A run that stopped itself and can say why in one line; subclasses set ``exit_code``."""

    exit_code = 1


def exits_with_one_line(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn a ConfigError (exit 2) or a RunStoppedError (its code) raised by ``fn`` into one line on stderr,
    printed once (``_shown_here``; a RunStoppedError by global rank 0)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as error:
            if _shown_here(error):
                print(f"error: {error}", file=sys.stderr, flush=True)
            if error.agreed:
                _after_rank0_said_it()
            raise SystemExit(CONFIG_ERROR_EXIT_CODE) from None
        except RunStoppedError as error:
            if is_global_rank0():  # exit 0: a run that had nothing left to do says so, as a plain line
                said = (sys.stderr, f"error: {error}") if error.exit_code else (sys.stdout, str(error))
                print(said[1], file=said[0], flush=True)
            raise SystemExit(error.exit_code) from None

    return wrapper
