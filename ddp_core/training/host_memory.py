"""Host memory a training step frees stays with the process for the next step, instead of going back to the kernel.

glibc's malloc hands freed memory back to the kernel when more than its trim threshold sits free at the top of the
heap, and it maps blocks above its mmap threshold afresh each time. Both thresholds start low (128 KiB) and only
some of glibc's own heuristics raise them, so a fresh process's CPU training step gives its activations back at
its end and takes them again, page by page, in the next: on the 2-core machine, the small CNN at batch 64 took
about 1,200 page faults a step and ran 4-11% slower than the same loop in a process whose earlier allocations had
happened to raise the thresholds (docs/benchmarks.md, "Host memory and page faults"). PyTorch's CUDA caching
allocator keeps freed GPU memory for the same reason.

``keep_freed_memory`` sets the two thresholds once per process: blocks up to ``MMAP_THRESHOLD`` come from the heap,
and up to ``TRIM_THRESHOLD`` of free memory stays there. The process's resident memory then stays near its
step's peak. A user's own choice is kept: with glibc's malloc variables or tunables set, or another allocator
preloaded (jemalloc, tcmalloc), nothing changes. Elsewhere than glibc it does nothing.
"""

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
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD"
    return None


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
