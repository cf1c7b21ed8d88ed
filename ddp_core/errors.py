"""Failures a user can act on, each reported as one line with its own exit code.

- ``ConfigError``: bad configuration, found before anything starts; exit code 2. ``NodeConfigError``:
  the same for a whole node, printed once per node.
- ``RunStoppedError``: a run that stopped itself for a reason it can state (it diverged, the disk is
  full); every rank raises it at the same step, global rank 0 prints the line, all exit with its code.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.ranks import is_global_rank0, is_local_rank0

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem the user can fix; reported as one line, exit code 2.

    ``agreed``: every rank of a process group raised it together (rank 0 decided): printed once, by global rank 0.
    """

    agreed = False


class NodeConfigError(ConfigError):
    """A configuration problem of a whole node (its network, its hosts file): every rank there raises the
    same one, and only the node's local rank 0 prints it."""


class AgreedConfigError(ConfigError):
    """A configuration problem every rank of a process group agreed on (rank 0 decided, all raise it together):
    printed once, by global rank 0, and no rank leaves before that line is out (``_after_rank0_said_it``)."""

    agreed = True


def _after_rank0_said_it() -> None:
    """Every rank raised the same AgreedConfigError and global rank 0 printed it: meet once more before leaving.

    A worker that exits first makes torchrun close the others with SIGTERM, and before training nothing
    catches that signal: rank 0 could be ended before its line was out, and the job would exit 2 without
    saying why. A barrier costs one round trip; a rank already gone makes it fail at once, not hang.
    """
    dist = sys.modules.get("torch.distributed")  # imported by whoever made the group; never imported here
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    try:
        dist.barrier()
    except Exception:  # the exit code still says what happened; the line was printed or the rank is gone
        pass


class RunStoppedError(RuntimeError):
    """A run that stopped itself and can say why in one line; subclasses set ``exit_code``."""

    exit_code = 1


def exits_with_one_line(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn a ConfigError (exit 2) or a RunStoppedError (its code) raised by ``fn`` into one line on stderr.

    A RunStoppedError is raised on every rank at once: only global rank 0 prints it, so the user reads
    the reason once, not once per process.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as error:
            if error.agreed:
                shown = is_global_rank0()
            else:
                shown = not isinstance(error, NodeConfigError) or is_local_rank0()
            if shown:
                print(f"error: {error}", file=sys.stderr, flush=True)
            if error.agreed:
                _after_rank0_said_it()
            raise SystemExit(CONFIG_ERROR_EXIT_CODE) from None
        except RunStoppedError as error:
            if is_global_rank0():
                print(f"error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(error.exit_code) from None

    return wrapper
