"""Where each rank is in a hang (docs/faults.md, "Finding a hang"). Every worker, and each process it forks (a loader),
answers ``SIGNAL`` with all its threads' stacks (faulthandler: no GIL needed) in its own file in the launcher's job
folder; a rank whose collective timed out records its own as it raised. The launcher gathers them before closing."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

from ddp_core.layout import stacks_name

SIGNAL = signal.SIGUSR2
TIMED_OUT = "Timed out in "  # a timed-out rank's own record: its header names the collective
WAIT_S = 2.0  # how long the launcher waits for the dumps: a stopped process never answers
_NAME = re.compile(r"stack_(\d+)_(\d+)(_child)?$")  # a job folder's file: rank, pid, and whether a forked child
_BLOCK, _FRAME = re.compile(r"^(.*) \(most recent call first\):$"), re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_STDLIB = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "platstdlib")})
_own: dict[str, Any] = {}  # this process's file, its rank and the folder
Frame = tuple[str, int, str]  # file, line, function


def register(job_dir: str | None, rank: str | None) -> None:
    """Answer ``SIGNAL`` with this process's stacks in ``job_dir`` (the launcher's); nothing without a launcher."""
    if job_dir and rank is not None:
        if not _own:
            os.register_at_fork(after_in_child=lambda: _answer(f"{_own['rank']}_{os.getpid()}_child"))
            os.register_at_fork(after_in_parent=_forget)
        for stale in Path(job_dir).glob(f"stack_{rank}_*"):  # this rank's processes before a restart
            stale.unlink(missing_ok=True)
        _own.update(rank=rank, job_dir=job_dir)
        _answer(f"{rank}_{os.getpid()}")


def _answer(name: str) -> None:
    with contextlib.suppress(OSError):  # the launcher's folder is gone: it reports nothing more
        _own["file"] = open(Path(_own["job_dir"]) / f"stack_{name}", "a")  # appended: a later dump follows
        faulthandler.register(SIGNAL, file=_own["file"], all_threads=True, chain=False)


def _forget() -> None:
    """After a fork, the files of this rank's forked processes that have ended (a loader's workers, each epoch) go."""
    for path in Path(_own["job_dir"]).glob(f"stack_{_own['rank']}_*_child"):
        if not Path(f"/proc/{path.name.split('_')[2]}").exists():
            path.unlink(missing_ok=True)


def on_abort() -> None:
    """A fatal signal's stacks (NCCL's watchdog aborts a rank whose collective timed out) go to the same file."""
    if "file" in _own:
        faulthandler.enable(file=_own["file"], all_threads=True)


def record_timeout(error: BaseException, collective: str) -> None:
    """This rank's stack where ``error`` (caught by the process group: the first frame, left out) was raised."""
    if "file" in _own:
        entries = list(traceback.walk_tb(error.__traceback__))[1:]
        frames = [*reversed(entries), *(traceback.walk_stack(entries[0][0].f_back) if entries else ())]
        lines = "".join(f'  File "{f.f_code.co_filename}", line {line} in {f.f_code.co_name}\n' for f, line in frames)
        with contextlib.suppress(OSError):  # the timeout's own error matters more than this record
            _own["file"].write(f"{TIMED_OUT}{collective} (most recent call first):\n{lines}\n")
            _own["file"].flush()


def gather(job_dir: str, run_dir: Path | None, codes: list[int | None]) -> None:
    """When a collective timed out (a rank's record, or an abort: NCCL's watchdog), every live process of this
    node that registered dumps its stacks; each rank's go to ``run_dir``, headed by its report line."""
    with contextlib.suppress(OSError):  # a folder gone or full: the report goes without the stacks
        files = {path: match for path in Path(job_dir).glob("stack_*") if (match := _NAME.match(path.name))}
        recorded = {path for path in files if TIMED_OUT in path.read_text(errors="replace")}
        if run_dir is None or not (recorded or -signal.SIGABRT in codes):
            return
        _dump({path: int(match[2]) for path, match in files.items() if path not in recorded})
        for rank in {int(match[1]) for match in files.values()}:
            texts = {path: path.read_text(errors="replace") for path, match in files.items() if int(match[1]) == rank}
            main = next((text for path, text in texts.items() if not files[path][3]), "")
            forked = {files[path][2]: text for path, text in texts.items() if files[path][3] and text}
            more = [f"--- process {pid}, forked by rank {rank}:\n{text}" for pid, text in forked.items()]
            report = [summary(rank, main, list(forked.values())), "", main, *more]
            (run_dir / stacks_name(rank)).write_text("\n".join(report))


def _catches(pid: int) -> bool:
    """Alive and catching ``SIGNAL`` (faulthandler's handler): any other process would die of it."""
    with contextlib.suppress(OSError):
        found = re.search(r"^SigCgt:\s*(\w+)", Path(f"/proc/{pid}/status").read_text(), re.M)
        return bool(found and int(found[1], 16) >> (SIGNAL - 1) & 1)
    return False


def _dump(processes: dict[Path, int]) -> None:
    """Each process (its file, its pid) that catches ``SIGNAL`` dumps; back when each file has grown and stays put."""
    asked = {path: path.stat().st_size for path, pid in processes.items() if _catches(pid)}
    for path in asked:
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(processes[path], SIGNAL)
    before, deadline = dict(asked), time.monotonic() + WAIT_S
    while asked and time.monotonic() < deadline:  # a deadline, not a synchronisation: a stopped process never answers
        time.sleep(0.05)
        sizes = {path: path.stat().st_size for path in asked}
        asked = {path: size for path, size in sizes.items() if size == before[path] or size != asked[path]}


def threads(text: str) -> list[tuple[str, list[Frame]]]:
    """A file's blocks (threads, a timed-out rank's record): header, frames innermost first. Main threads come last."""
    found: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        if block := _BLOCK.match(line):
            found.append((block[1], []))
        elif (frame := _FRAME.match(line)) and found:
            found[-1][1].append((frame[1], int(frame[2]), frame[3]))
    return found


def innermost(frames: list[Frame]) -> str | None:
    """``experiments/mine.py:88 read_shard``: the innermost frame of the user's code or ddp-lab's."""
    for path, line, function in frames:
        library = path.startswith(("<", *_STDLIB)) or re.search(r"/(site|dist)-packages/", path)
        if not library or "/ddp_core/" in path:
            return f"{os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path}:{line} {function}"
    return None


def summary(rank: int, main: str, forked: list[str]) -> str:
    """The report's line for ``rank`` from its dumps (``main``) and its forked processes' (a loader's workers)."""
    blocks = threads(main)
    if not blocks:
        return f"rank {rank}: no stack (the process did not answer)"
    header, frames = ([block for block in blocks if block[0].startswith(TIMED_OUT)] or blocks)[-1]
    where = innermost(frames)
    if any("/torch/utils/data/" in path for path, _, _ in frames):  # it waits on its loader: a worker may say why
        for theirs in (threads(text)[-1][1] for text in forked if threads(text)):
            own = innermost(theirs[: next((i for i, f in enumerate(theirs) if f[2] == "_bootstrap"), len(theirs))])
            if own is not None:  # a frame of its own (inside the process's _bootstrap), not its parent's
                where = f"{own} in a DataLoader worker"
                break
    waits = f", in {header.removeprefix(TIMED_OUT)}" if header.startswith(TIMED_OUT) else " (no collective)"
    waits = " (aborted)" if "Fatal Python error" in main else waits  # NCCL's watchdog ended it
    return f"rank {rank}: {where or 'no frame of its own code'}{waits}"
