"""Run an experiment under torchrun, as a world of one, or in N processes started with torch.multiprocessing."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch.multiprocessing as mp

from ddp_core.config import CommonArgs
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.process.exit import run_and_exit
from ddp_core.process.orphans import die_with_parent

A = TypeVar("A", bound=CommonArgs)
R = TypeVar("R")


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def threads_as_torchrun(nproc: int) -> Iterator[None]:
    """The processes started inside get the OpenMP threads torchrun gives its workers.

    torchrun's rule (``torch.distributed.run.run``): with more than one process on the node and no
    ``OMP_NUM_THREADS`` in the environment (set, even empty, it is the user's and is kept), every worker
    gets ``OMP_NUM_THREADS=1``. OpenMP reads it when torch loads, so it must be in the environment the
    processes start with. Without it each of N processes used every core: N times too many threads.
    """
    if "OMP_NUM_THREADS" in os.environ or nproc <= 1:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def _spawned_worker(
    local_rank: int, worker: Callable[[Any], Any], args: Any, nproc: int, port: int, launcher: int
) -> None:
    die_with_parent(launcher)  # first: a launcher killed by SIGKILL must not leave this worker training on
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Finished, or stopped with a stated code and its one line (ddp_core.errors): leave before interpreter
    # finalization, where torch's gloo threads can abort a process whose work is done (ddp_core/process/exit.py).
    # Exceptions propagate to spawn's handler.
    run_and_exit(functools.partial(exits_with_one_line(worker), args))


def launch(worker: Callable[[A], R], args: A) -> R | None:
    """``worker(args)`` here, or in ``args.nproc`` local processes (the DDP tutorials' ``mp.spawn`` path).

    The spawned processes get the same variables torchrun would set, and its OpenMP threads
    (``threads_as_torchrun``), so they run exactly the code a torchrun launch runs; each dies with this
    process (``ddp_core.process.orphans``). Returns the worker's result when it ran in this process.
    """
    nproc = args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be >= 1")
    if nproc == 1:
        return worker(args)
    if "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        raise ConfigError(
            "--nproc starts processes itself and cannot run under torchrun: use torchrun --nproc-per-node instead"
        )
    # When one worker ends, torch terminates the others and says so per process; a worker that failed has
    # printed why (one line, or its traceback), which must stay the last thing the user reads.
    logging.getLogger("torch.multiprocessing.spawn").addFilter(
        lambda record: not record.getMessage().startswith("Terminating process")
    )
    try:
        with threads_as_torchrun(nproc):
            mp.start_processes(
                _spawned_worker,
                args=(worker, args, nproc, free_port(), os.getpid()),
                nprocs=nproc,
                join=True,
                start_method="spawn",
            )
    except mp.ProcessExitedException as error:
        raise SystemExit(error.exit_code if error.exit_code and error.exit_code > 0 else 1) from None
    return None
