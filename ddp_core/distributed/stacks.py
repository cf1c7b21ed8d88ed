"""Where each rank is when a job hangs: its Python line, not only its collective (docs/faults.md, "Finding a hang").

A worker answers ``SIGNAL`` with every thread's stack (``faulthandler``: written without the GIL, so a rank stuck
in native code answers too), appended to its own file in the launcher's job folder; so does each process it forks
(a DataLoader's workers). A rank whose collective timed out records its own stack as the collective raised. Before
a hung job's workers are closed, its launcher has every live one dump, and writes each rank's stacks to the run
directory under a first line that names the rank's innermost frame in the user's code or ddp-lab's.
"""

from __future__ import annotations

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
_BLOCK = re.compile(r"^(.*) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_STDLIB = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "platstdlib")})
_PACKAGES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_own: dict[str, Any] = {}  # this process's file, its rank and folder


def register(job_dir: str | None, rank: str | None) -> None:
    """Answer ``SIGNAL`` with this process's stacks in ``job_dir`` (the launcher's); nothing without a launcher."""
    if not job_dir or rank is None:
        return
    if not _own:
        os.register_at_fork(after_in_child=lambda: _answer(f"{_own['rank']}_{os.getpid()}_child"))
    _own.update(rank=rank, job_dir=job_dir)
    _answer(f"{rank}_{os.getpid()}")


def _answer(name: str) -> None:
    try:
        _own["file"] = open(Path(_own["job_dir"]) / f"stack_{name}", "a")  # appended: a later dump follows
    except OSError:
        return  # the launcher's folder is gone: it reports nothing more
    faulthandler.register(SIGNAL, file=_own["file"], all_threads=True, chain=False)


def on_abort() -> None:
    """A fatal signal's stacks (NCCL's watchdog aborts a rank whose collective timed out) go to the same file."""
    if _own:
        faulthandler.enable(file=_own["file"], all_threads=True)


def record_timeout(error: BaseException, collective: str) -> None:
    """This rank's stack where ``error`` (caught by the process group, the first frame) was raised."""
    if not _own:
        return
    entries = list(traceback.walk_tb(error.__traceback__))[1:]
    frames = [*reversed(entries), *(traceback.walk_stack(entries[0][0].f_back) if entries else ())]
    lines = (f'  File "{frame.f_code.co_filename}", line {line} in {frame.f_code.co_name}' for frame, line in frames)
    _own["file"].write(f"{TIMED_OUT}{collective} (most recent call first):\n" + "\n".join(lines) + "\n\n")
    _own["file"].flush()


def _answers(pid: int) -> bool:
    """Alive and catching ``SIGNAL`` (faulthandler's handler): any other process would die of it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught >> (SIGNAL - 1) & 1)


def clear(job_dir: str | None) -> None:
    """A new group of workers starts: the files of the last one's processes are stale."""
    for path in Path(job_dir).glob("stack_*") if job_dir else ():
        path.unlink(missing_ok=True)


def gather(job_dir: str, run_dir: Path | None, codes: list[int | None]) -> None:
    """When a collective timed out (a rank's record, or an abort: NCCL's watchdog), every live process of this
    node that registered dumps its stacks; each rank's go to ``run_dir``, headed by its report line."""
    files = {path: match for path in Path(job_dir).glob("stack_*") if (match := _NAME.match(path.name))}
    recorded = {path for path in files if TIMED_OUT in path.read_text(errors="replace")}
    if run_dir is None or not (recorded or -signal.SIGABRT in codes):
        return
    _dump({path: int(match[2]) for path, match in files.items() if path not in recorded})
    for rank in {int(match[1]) for match in files.values()}:
        texts = {path: path.read_text(errors="replace") for path, match in files.items() if int(match[1]) == rank}
        main = next((text for path, text in texts.items() if not files[path][3]), "")
        forked = {files[path][2]: text for path, text in texts.items() if files[path][3] and text}
        parts = [summary(rank, main, list(forked.values())), "", main]
        parts += [
            f"--- process {pid}, forked by rank {rank} (a DataLoader worker?):\n{text}" for pid, text in forked.items()
        ]
        (run_dir / stacks_name(rank)).write_text("\n".join(parts))


def _dump(processes: dict[Path, int]) -> None:
    """Each live process of ``processes`` (its file, its pid) dumps; back when each file has grown and stays put."""
    asked = {path: path.stat().st_size for path, pid in processes.items() if _answers(pid)}
    for path in asked:
        os.kill(processes[path], SIGNAL)
    before, deadline = dict(asked), time.monotonic() + WAIT_S
    while asked and time.monotonic() < deadline:  # a deadline, not a synchronisation: a stopped process never answers
        time.sleep(0.05)
        sizes = {path: path.stat().st_size for path in asked}
        asked = {path: size for path, size in sizes.items() if size == before[path] or size != asked[path]}


Frame = tuple[str, int, str]  # file, line, function


def threads(text: str) -> list[tuple[str, list[Frame]]]:
    """Each block of a file's dumps (a thread, or a timed-out rank's record): its header and frames, innermost
    first. Within a dump faulthandler lists the main thread last."""
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
        library = path.startswith(("<", *_STDLIB)) or any(mark in path for mark in _PACKAGES)
        if not library or f"{os.sep}ddp_core{os.sep}" in path:
            shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
            return f"{shown}:{line} {function}"
    return None


def summary(rank: int, main: str, forked: list[str]) -> str:
    """The report's line for ``rank`` from its dumps (``main``) and its forked processes' (a loader's workers)."""
    blocks = threads(main)
    if not blocks:
        return f"rank {rank}: no stack (the process did not answer)"
    header, frames = ([block for block in blocks if block[0].startswith(TIMED_OUT)] or blocks)[-1]
    where = innermost(frames)
    if any(f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}" in path for path, _, _ in frames):
        for text in forked:  # the rank waits on its loader: a worker's own frames (inside its _bootstrap) say why
            theirs = (threads(text) or [("", [])])[-1][1]
            own = innermost(theirs[: next((i for i, f in enumerate(theirs) if f[2] == "_bootstrap"), len(theirs))])
            if own is not None:
                where = f"{own} in a DataLoader worker"
                break
    collective = (
        f", in {header.removeprefix(TIMED_OUT)}"
        if header.startswith(TIMED_OUT)
        else " (aborted)"
        if "Fatal Python error" in main
        else " (no collective)"
    )
    return f"rank {rank}: {where or 'no frame of its own code'}{collective}"


def report_lines(run_dir: Path | None, ranks: list[int]) -> list[str]:
    """Each rank's line, from the files ``gather`` wrote."""
    paths = [run_dir / stacks_name(rank) for rank in sorted(ranks)] if run_dir is not None else []
    return [path.read_text().split("\n", 1)[0] for path in paths if path.is_file()]
