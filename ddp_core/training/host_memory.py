"""Host memory a training step frees stays with the process for the next step: glibc's low default thresholds gave
it back to the kernel and faulted it in again every step. A user's own malloc settings or allocator are kept
(docs/decisions.md, "Host memory kept between steps")."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit: bigger blocks are still mapped, and unmapped
TRIM_THRESHOLD = 2**30
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def users_choice(environ: Mapping[str, str]) -> str | None:
    """The variable through which the user already chose how the process allocates, if any."""
    for name in USER_SETTINGS:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return "LD_PRELOAD" if environ.get("LD_PRELOAD", "").strip() else None


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> str:
    """Set glibc's thresholds (once is enough; again is harmless). Returns what it did, for the log."""
    if not sys.platform.startswith("linux"):
        return "kept: not Linux"
    if chosen := users_choice(environ):
        return f"kept: {chosen} is set"
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return "kept: not glibc"
    set_mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    set_trim = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return "set" if set_mmap == 1 and set_trim == 1 else "kept: glibc refused the thresholds"
