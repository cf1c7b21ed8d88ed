"""Bad configuration: one line naming what is wrong and how to fix it, exit code 2."""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

T = TypeVar("T")

CONFIG_ERROR_EXIT_CODE = 2


class ConfigError(ValueError):
    """A configuration problem the user can fix; reported as one line, exit code 2."""


def exits_2_on_config_error(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn a ConfigError raised by ``fn`` into a one-line message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_ERROR_EXIT_CODE) from None

    return wrapper
