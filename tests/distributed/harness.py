"""Run a function in N real processes that form a gloo process group, and hand back every rank's result.

    results = run_distributed(fn, 3, "arg", tmp_dir=tmp_path)   # results[r] is fn's return value on rank r

``fn(rank, world_size, *args)`` runs in ``world_size`` processes started with torch.multiprocessing (start
method forkserver, see below), each inside
``ddp_core.distributed.group.process_group(DistConfig(backend="gloo", timeout_s=...))`` with
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) set in
the child's ``os.environ``, exactly the variables torchrun sets. Inside ``fn``, ``context()`` returns the
``DistContext`` that ``process_group`` yielded (for ``wrap_ddp``).

Each child ``torch.save``s its return value to ``tmp_dir / f"rank{r}.pt"`` and the parent loads them. An
exception in any child fails the call with a ``RankError`` that holds every failed rank's traceback in rank
order (so the original error is never hidden behind a peer's "connection reset by peer");
``torch.multiprocessing`` terminates the other children. A child that hangs past ``join_timeout_s`` is
killed and the call fails with a TimeoutError naming it.

``spawn_ranks`` is the raw form: only the given ranks of a world are started and no process group is
created for them, so a test can drive ``process_group`` itself and look at how it fails.

Worker functions must be defined at module level (spawned children import them by name). Children are
forked from one fork server per test session that has imported torch and the worker modules already
(``PRELOADED``): a child starts in a fraction of a second, not the 1.5-3 s of CPU an ``import torch`` costs
(a clean interpreter per child, as spawn gives, but without the import). A forked child would inherit the
server's environment, from when it started; each child takes its parent's ``os.environ`` of the moment
instead, as a spawned one would.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from ddp_core.distributed.group import DistConfig, DistContext, process_group
from ddp_core.process.exit import leave
from ddp_core.process.launch import free_port

# Variables a parent (a test runner started under torchrun, a developer's shell) may have set that would
# change what a child does; each child starts without them.
FOREIGN_VARIABLES = (
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "INIT_METHOD",
    "BACKEND",
    "DIST_TIMEOUT_S",
    "DIST_INIT_TIMEOUT_S",
)

# Imported once, by the fork server, before it forks any child; workers outside this list still work (imported by
# the child).
# torch._dynamo: DistributedDataParallel's constructor imports it (about 0.85 s of CPU), in every child that wraps
# a model.
PRELOADED = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "ddp_core.distributed.group",
    "tests.distributed.harness",
    "tests.distributed.workers",
    "tests.distributed.sync_bn_workers",
    "tests.distributed.cifar10_workers",
]
mp.set_forkserver_preload(PRELOADED)

DEFAULT_GROUP_TIMEOUT_S = 60.0  # collectives that never complete fail the test instead of hanging it
DEFAULT_JOIN_TIMEOUT_S = 120.0

_CONTEXT: DistContext | None = None


class RankError(RuntimeError):
    """One or more spawned ranks failed; the message holds every failed rank's traceback, in rank order."""


def context() -> DistContext:
    """The DistContext of the process group this child runs in (only inside a ``run_distributed`` worker)."""
    if _CONTEXT is None:
        raise RuntimeError("context() is only available inside a function run by run_distributed")
    return _CONTEXT


def _set_launch_env(rank: int, world_size: int, port: int) -> None:
    for name in FOREIGN_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _child(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    ranks: tuple[int, ...],
    world_size: int,
    port: int,
    out_dir: str,
    group_timeout_s: float | None,
    environment: dict[str, str],
) -> None:
    """Entry point of every spawned process; ``index`` is its position in ``ranks``."""
    global _CONTEXT
    rank = ranks[index]
    os.environ.clear()
    os.environ.update(environment)  # the parent's now, not the fork server's when it started
    _set_launch_env(rank, world_size, port)
    torch.set_num_threads(1)  # several processes share 2 cores
    out = Path(out_dir)
    try:
        if group_timeout_s is None:
            result = fn(rank, world_size, *args)
        else:
            with process_group(DistConfig(backend="gloo", timeout_s=group_timeout_s)) as ctx:
                _CONTEXT = ctx
                try:
                    result = fn(rank, world_size, *args)
                finally:
                    _CONTEXT = None
    except BaseException:
        # Written before this process exits: a rank whose peers fail only BECAUSE it died (gloo's
        # "connection closed") cannot hide this, the original error, from the parent.
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    torch.save(result, out / f"rank{rank}.pt")
    # A finished child leaves the way ddp-lab's workers do: past gloo's teardown abort (docs/design.md, "Gloo
    # teardown"). On this spawn path the abort did not show in 100 runs either way (docs/benchmarks.md): a precaution.
    leave(0)


def _start(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    ranks: Sequence[int],
    world_size: int,
    tmp_dir: str | Path,
    group_timeout_s: float | None,
    join_timeout_s: float,
    port: int | None,
) -> dict[int, Any]:
    ranks = tuple(ranks)
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"ranks {ranks} must be distinct and within 0..{world_size - 1}")
    out_dir = Path(tmp_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        (out_dir / f"rank{r}.pt").unlink(missing_ok=True)
        (out_dir / f"rank{r}.error").unlink(missing_ok=True)
    port = free_port() if port is None else port
    procs = mp.start_processes(
        _child,
        args=(fn, args, ranks, world_size, port, str(out_dir), group_timeout_s, dict(os.environ)),
        nprocs=len(ranks),
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + join_timeout_s
    # join() raises (ProcessRaisedException, ProcessExitedException) as soon as one child failed, after
    # terminating the others; it returns True once every child exited cleanly.
    try:
        while not procs.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                alive = [ranks[i] for i, p in enumerate(procs.processes) if p.is_alive()]
                for p in procs.processes:
                    if p.is_alive():
                        p.kill()
                for p in procs.processes:
                    p.join()
                raise TimeoutError(
                    f"{fn.__name__}: rank(s) {alive} of {world_size} still running after {join_timeout_s:g} s; killed"
                )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        failures = [(r, out_dir / f"rank{r}.error") for r in ranks]
        details = "\n".join(
            f"--- rank {r} of {world_size} ---\n{path.read_text()}" for r, path in failures if path.is_file()
        )
        raise RankError(f"{fn.__name__} failed in a spawned rank:\n{details or error}") from error
    results = {}
    for r in ranks:
        path = out_dir / f"rank{r}.pt"
        if not path.is_file():
            raise RuntimeError(f"{fn.__name__}: rank {r} exited without writing its result {path}")
        results[r] = torch.load(path, weights_only=False)  # our own children's files
    return results


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tmp_dir: str | Path,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a fresh gloo group; returns ``[result of rank 0, ...]``."""
    results = _start(fn, args, range(world_size), world_size, tmp_dir, timeout_s, join_timeout_s, None)
    return [results[r] for r in range(world_size)]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    ranks: Sequence[int],
    *args: Any,
    tmp_dir: str | Path,
    port: int | None = None,
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
) -> dict[int, Any]:
    """``fn(rank, world_size, *args)`` in one process per rank in ``ranks``, launch variables set, NO group created.

    ``port`` is MASTER_PORT (a free one if None). Returns ``{rank: result}``.
    """
    return _start(fn, args, ranks, world_size, tmp_dir, None, join_timeout_s, port)


def section(per_rank: list[dict[str, Any]], name: str) -> list[Any]:
    """Every rank's result of one ``workers.world_checks`` section; fails with the traceback of a rank where
    it raised."""
    for r, result in enumerate(per_rank):
        entry = result[name]
        assert entry["ok"], f"section {name!r} raised on rank {r} of {len(per_rank)}:\n{entry['error']}"
    return [result[name]["result"] for result in per_rank]


class SpawnedWorlds(dict):
    """``worlds[world_size]``: every rank's result of ``fn(rank, world_size, *args_for(folder))``.

    Each world size is spawned once, on first use, and shared by the tests that read it (a spawn costs
    seconds); a world that failed is not spawned again.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        tmp_path_factory: Any,
        args_for: Callable[[Path], tuple[Any, ...]] = lambda folder: (),
    ) -> None:
        super().__init__()
        self._fn, self._tmp, self._args_for = fn, tmp_path_factory, args_for
        self._failed: dict[int, BaseException] = {}

    def __missing__(self, world_size: int) -> list[Any]:
        if world_size in self._failed:
            raise RuntimeError(f"the {world_size}-rank run failed (see the first test that used it)") from self._failed[
                world_size
            ]
        folder = self._tmp.mktemp(f"{self._fn.__name__}_world{world_size}")
        try:
            self[world_size] = run_distributed(
                self._fn, world_size, *self._args_for(folder), tmp_dir=folder / "results"
            )
        except BaseException as error:
            self._failed[world_size] = error
            raise
        return self[world_size]
