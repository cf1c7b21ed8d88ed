"""A run that cannot write its files stops on every rank at the same point, with one line and exit code 74.

Only rank 0 writes, inside ``rank0_decides``, so every rank raises the same ``StorageError``
(docs/decisions.md, "Checkpoints on disk").
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from ddp_core.errors import RunStoppedError
from ddp_core.exit_codes import STORAGE_EXIT_CODE

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EFBIG})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class StorageError(RunStoppedError):
    """Rank 0 could not write a file of the run directory; the message names it and the intact checkpoint."""

    exit_code = STORAGE_EXIT_CODE


def is_storage_error(error: BaseException) -> bool:
    """A full disk, a permission or a read-only filesystem: the storage's fault, not the program's."""
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: torch.save turns a failed ``write`` into a RuntimeError whose context it is."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def describe(path: str | Path, error: OSError, intact: str | None, needed_bytes: int | None = None) -> str:
    """One line: the path, the error (space needed and free for a full disk), the intact checkpoint (``intact``;
    None: none yet) and what to do."""
    name = errno.errorcode.get(error.errno or 0)
    detail = [name] if name else []
    if error.errno in _FULL:
        if needed_bytes:
            detail.append(f"it needs about {_disk_size(needed_bytes)}")
        free = _free_bytes(Path(path))
        if free is not None:
            detail.append(f"{_disk_size(free)} free")
    reason = error.strerror or str(error) or type(error).__name__
    text = f"cannot write {path}: {reason}" + (f" ({'; '.join(detail)})" if detail else "")
    if error.errno in _FULL:
        fix = "free some space there (or move the run directory to a larger disk)"
    elif error.errno == errno.EROFS:
        fix = "remount that filesystem read-write (or move the run directory)"
    elif error.errno in (errno.EACCES, errno.EPERM):
        fix = "make the run directory writable for this user"
    else:
        fix = "check that disk"
    if intact is None:
        return f"{text}; no checkpoint had been written yet; {fix}, then start the run again"
    return f"{text}; {intact}; {fix}, then continue with --resume"


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def _disk_size(count: float) -> str:
    if count < 1000:
        return f"{count:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        count /= 1000
        if count < 1000 or unit == "TB":
            break
    return f"{count:.1f} {unit}"
