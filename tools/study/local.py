"""The study's runs on this machine: at most ``--parallel`` at once, each with GPUs of its own and one OpenMP
thread per process whatever ``--parallel`` is (docs/decisions.md, "Studies"). SIGTERM stops every run with a
checkpoint; a run that fails or diverges does not stop the others."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ddp_core.errors import ConfigError
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE, STOPPED_EXIT_CODE

if TYPE_CHECKING:
    from tools.study.grid import Study, Task


@dataclass(frozen=True)
class Ending:
    """A run that did not finish, for the lines after the table."""

    label: str
    state: str
    code: int | None  # None: it ended in an earlier start, or under a scheduler (its log says)
    why: str  # the last line of its log
    log: Path

    def line(self) -> str:
        code = "" if self.code is None else f" (exit {self.code})"
        return f"{self.label}: {self.state}{code}: {self.why} (log {self.log})"


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES names them to the runs."""
    import torch

    count = torch.cuda.device_count()
    listed = [item.strip() for item in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    return listed[:count] if "CUDA_VISIBLE_DEVICES" in environ else [str(index) for index in range(count)]


def slots(parallel: int, nproc: int, gpus_per_run: int | None, environ: Mapping[str, str]) -> list[dict[str, str]]:
    """What each of the ``parallel`` concurrent runs gets on top of this environment; ConfigError on bad values."""
    if gpus_per_run is not None and gpus_per_run < 0:
        raise ConfigError(f"--gpus-per-run {gpus_per_run}: 0 (CPU) or more GPUs per run")
    gpus = visible_gpus(environ)
    per_run = gpus_per_run if gpus_per_run is not None else (nproc if gpus else 0)
    if per_run > len(gpus):
        given = f"--gpus-per-run {per_run}" if gpus_per_run is not None else f"--nproc {nproc} (one GPU each)"
        raise ConfigError(
            f"{given}: this machine has {len(gpus)} GPU(s) visible: at most {len(gpus)} per run"
            + (", or --gpus-per-run 0 for CPU runs" if gpus else " (--gpus-per-run 0: CPU)")
        )
    if 0 < per_run < nproc:
        raise ConfigError(
            f"--gpus-per-run {per_run} is fewer than --nproc {nproc}: each process needs a GPU of its own "
            f"(--gpus-per-run {nproc}, or 0 for CPU runs)"
        )
    if per_run and parallel * per_run > len(gpus):
        raise ConfigError(
            f"--parallel {parallel} runs x {per_run} GPU(s) needs {parallel * per_run} GPUs, this machine has "
            f"{len(gpus)}: --parallel {len(gpus) // per_run} at most"
        )
    own: dict[str, str] = {} if "OMP_NUM_THREADS" in environ else {"OMP_NUM_THREADS": "1"}
    if per_run:
        return [
            {**own, "CUDA_VISIBLE_DEVICES": ",".join(gpus[k * per_run : (k + 1) * per_run])} for k in range(parallel)
        ]
    return [{**own, **({"CUDA_VISIBLE_DEVICES": ""} if gpus else {})} for _ in range(parallel)]


class _Stop:
    """SIGTERM or SIGINT: no new run starts; a SIGTERM is passed on to every running run, once each (Ctrl-C
    reaches them from the terminal itself)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.running: list[subprocess.Popen] = []
        self._told: set[int] = set()

    def __call__(self, signum: int, frame: Any) -> None:
        self.signal = signum
        if signum == signal.SIGTERM:
            self.tell_all()

    def tell_all(self) -> None:
        for child in list(self.running):
            if child.returncode is None and child.pid not in self._told:
                self._told.add(child.pid)
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:  # it has just ended
                    pass

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self)


def run_local(
    study: Study,
    todo: list[Task],
    resources: list[dict[str, str]],
    command: Callable[[Study, Task], list[str]],
) -> list[Ending]:
    """``todo``'s runs, at most ``len(resources)`` at once, one progress line; the runs that did not finish."""
    from tqdm import tqdm

    from tools.study.grid import state_after

    stop = _Stop()
    stop.install()
    ended: queue.Queue[tuple[subprocess.Popen, int]] = queue.Queue()
    waiting, free = list(todo), list(range(len(resources)))
    running: dict[subprocess.Popen, tuple[Task, int, float]] = {}
    endings: list[Ending] = []
    refused: str | None = None
    done = len(study.tasks) - len(todo)
    with tqdm(total=len(study.tasks), initial=done, unit="run", desc=study.name, file=sys.stderr) as bar:
        while waiting or running:
            while waiting and free and stop.signal is None and refused is None:
                task, slot = waiting.pop(0), free.pop(0)
                with open(task.log, "a") as log:
                    child = subprocess.Popen(
                        command(study, task),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **resources[slot]},
                    )
                running[child] = (task, slot, time.monotonic())
                stop.running.append(child)
                threading.Thread(target=lambda c=child: ended.put((c, c.wait())), daemon=True).start()
                if stop.signal == signal.SIGTERM:  # it came while this run was starting
                    stop.tell_all()
            if not running:
                break
            bar.set_postfix_str(f"{len(running)} running, {len(waiting)} waiting")
            child, code = ended.get()  # signal handlers run while this waits
            task, slot, started = running.pop(child)
            stop.running.remove(child)
            free.append(slot)
            task.state = state_after(task, code)
            line = f"{task.label}: {task.state} (exit {code}, {time.monotonic() - started:.0f} s, log {task.log})"
            bar.write(line, file=sys.stderr)
            bar.set_postfix_str(f"{len(running)} running, {len(waiting)} waiting", refresh=False)
            bar.update(1)
            if code == CONFIG_ERROR_EXIT_CODE and refused is None:
                refused = f"{task.label} refused its flags: {last_line(task.log)}"
            elif code == STOPPED_EXIT_CODE and stop.signal is None:
                stop(signal.SIGTERM, None)  # one run stopped from outside: the study stops, every run with a checkpoint
            elif task.state != "finished":
                endings.append(Ending(task.label, task.state, code, last_line(task.log), task.log))
    if stop.signal is not None:
        print(f"study {study.name} stopped: the same command continues it", file=sys.stderr)
        raise SystemExit(STOPPED_EXIT_CODE)
    if refused is not None:
        raise ConfigError(refused)
    order = {task.label: index for index, task in enumerate(todo)}
    return sorted(endings, key=lambda ending: order[ending.label])  # the study's order, not the order they ended
