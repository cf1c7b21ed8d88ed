"""Run a module as ``__main__`` and record what any process but global rank 0 writes into a folder.

    torchrun --nproc-per-node=2 -m tools.write_audit REPORT_DIR WATCHED_DIR MODULE [ARGS...]

``tools.contract`` runs experiments so. Audit hooks (PEP 578) see Python's writes; ``torch.save`` with a path
writes from C++, so a profiler hook reads its path (a profiler of the program's own hides those). Each rank but 0
appends to ``REPORT_DIR/rank<N>.txt`` as it happens (a worker may leave by ``os._exit``).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ddp_core.ranks import is_global_rank0

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit event -> positions of the path arguments it writes to
_PATH_EVENTS = {
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.truncate": (0,),
    "os.rename": (0, 1),
    "os.replace": (0, 1),
    "os.link": (1,),
    "os.symlink": (1,),
    "shutil.copyfile": (1,),
    "shutil.rmtree": (0,),
}


class WriteAudit:
    def __init__(self, report: Path, watched: Path, rank: str) -> None:
        self.report = report / f"rank{rank}.txt"
        self.watched = os.path.realpath(watched)
        self.rank = rank
        self.seen: set[tuple[str, str]] = set()
        self._busy = False

    def _inside(self, path: Any) -> str | None:
        if isinstance(path, int) or path is None:
            return None  # a file descriptor: its open was seen already
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None
        return real if real == self.watched or real.startswith(self.watched + os.sep) else None

    def record(self, what: str, path: Any) -> None:
        real = self._inside(path)
        if real is None or (what, real) in self.seen or self._busy:
            return
        self.seen.add((what, real))
        self._busy = True  # writing the report opens a file: that open must not be audited again
        try:
            fd = os.open(self.report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"rank {self.rank} {what} {os.path.relpath(real, self.watched)}\n".encode())
            finally:
                os.close(fd)
        finally:
            self._busy = False

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writes:
                self.record("wrote", path)
        elif event in _PATH_EVENTS:
            for position in _PATH_EVENTS[event]:
                if position < len(args):
                    self.record(event, args[position])

    def watch_torch_save(self) -> None:
        import torch

        save = torch.save.__code__

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code is save:
                path = frame.f_locals.get("f")
                if isinstance(path, (str, bytes, os.PathLike)):
                    self.record("torch.save", path)

        sys.setprofile(profile)
        threading.setprofile(profile)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python -m tools.write_audit REPORT_DIR WATCHED_DIR MODULE [ARGS...]")
    report, watched, module, *args = argv
    if not is_global_rank0():
        audit = WriteAudit(Path(report), Path(watched), os.environ.get("RANK", ""))
        audit.watch_torch_save()
        sys.addaudithook(audit.hook)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
