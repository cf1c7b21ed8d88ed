"""Run an experiment under torchrun, as a world of one, or in N processes started with torch.multiprocessing."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch.multiprocessing as mp

from ddp_core.config import CommonArgs
from ddp_core.distributed import stacks
from ddp_core.errors import ConfigError, alike_on_the_node, exits_with_one_line
from ddp_core.exit_codes import FAILED_EXIT_CODE
from ddp_core.process import failure_report, heartbeat
from ddp_core.process.exit import run_and_exit
from ddp_core.process.orphans import die_with_launcher, die_with_parent

A = TypeVar("A", bound=CommonArgs)
R = TypeVar("R")


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def threads_as_torchrun(nproc: int) -> Iterator[None]:
    """torchrun's rule for the processes started inside: ``OMP_NUM_THREADS=1`` with more than one process, unless
    the user set it (even empty). Without it each of N processes used every core."""
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
    stacks.register(os.environ.get(heartbeat.JOB_DIR_ENV), str(local_rank))
    run_and_exit(functools.partial(exits_with_one_line(worker), args))  # exceptions propagate to spawn's handler


def launch(worker: Callable[[A], R], args: A) -> R | None:
    """``worker(args)`` here (its result), or in ``args.nproc`` local processes that get torchrun's variables and
    threads, so they run exactly what a torchrun launch runs; each dies with this process."""
    die_with_launcher()  # first: under ddp_core.torchrun, a launcher killed by SIGKILL takes this worker with it
    stacks.register(os.environ.get(heartbeat.JOB_DIR_ENV), os.environ.get("RANK"))  # for a hang's report
    nproc = args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be >= 1")
    if nproc == 1:
        return worker(args)
    if "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        with alike_on_the_node():  # every process of the node got the same flag: the node says it once
            raise ConfigError(
                f"--nproc={nproc} starts processes itself and cannot run under a launcher: drop it and give the "
                "launcher --nproc-per-node instead"
            )
    # When one worker ends, torch terminates the others and says so per process; the report below (or a stated
    # exit's one line, printed by the worker) must stay the last thing the user reads.
    logging.getLogger("torch.multiprocessing.spawn").addFilter(
        lambda record: not record.getMessage().startswith(("Terminating process", "Unable to shutdown process"))
    )
    job_dir = tempfile.mkdtemp(prefix="ddp-lab-job-")  # the workers' heartbeats (ddp_core.process.heartbeat)
    try:
        with threads_as_torchrun(nproc), _environ(heartbeat.JOB_DIR_ENV, job_dir):
            context = mp.start_processes(
                _spawned_worker,
                args=(worker, args, nproc, free_port(), os.getpid()),
                nprocs=nproc,
                join=False,
                start_method="spawn",
            )
            # A hang's stacks are taken at the first exit, before join stops the others
            multiprocessing.connection.wait(list(context.sentinels))
            stacks.gather(job_dir, heartbeat.run_dir(job_dir), [process.exitcode for process in context.processes])
            # After a failure the others get FAILED_JOB_GRACE_S to leave, then SIGTERM, then as long again
            # before SIGKILL (torch's default: 30 s, which a hung rank always waited out).
            while not context.join(grace_period=FAILED_JOB_GRACE_S):
                pass
    except mp.ProcessExitedException as error:
        code = error.exit_code
        if code is not None and code > 0 and code != FAILED_EXIT_CODE:  # a stated code: the worker said why
            raise SystemExit(code) from None
        raise SystemExit(_report(error.error_index, code if code is not None else 1, "", "", job_dir)) from None
    except mp.ProcessRaisedException as error:
        trace = str(error).split("terminated with the following error:\n", 1)[-1].rstrip()
        message = trace.splitlines()[-1] if trace else ""
        raise SystemExit(_report(error.error_index, 1, message, trace, job_dir)) from None
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return None


FAILED_JOB_GRACE_S = 1.5


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _report(rank: int, exitcode: int, message: str, trace: str, job_dir: str) -> int:
    """The launcher's report of the worker that failed first (ddp_core.process.failure_report); its exit code."""
    failure = failure_report.RankFailure(rank, socket.gethostname(), exitcode, message, trace)
    first = f"rank {rank} failed first (exit code {exitcode}); torch.multiprocessing stopped the others"
    return failure_report.report_and_print([failure], job_dir, 0, [first, trace])
