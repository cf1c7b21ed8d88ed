"""The process group: backend and device choice, explicit timeout, restart-safe store, guaranteed teardown."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.distributed import cuda, flight_recorder, network, stacks
from ddp_core.distributed.env import DistEnv, check_resolves, joining, rendezvous_round
from ddp_core.distributed.network import NetworkChoice
from ddp_core.errors import ConfigError, NodeConfigError

BACKENDS = ("auto", "nccl", "gloo")
# Two timeouts (docs/decisions.md, "Two timeouts"): a long one while the job sets itself up (rendezvous, slow
# nodes, data, a resume's checkpoint, the first step's compilation), a short one for every collective after.
DEFAULT_INIT_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT_S = 120.0  # never torch's 30-minute default: a hung job should fail while someone still watches
# What a timed-out collective waited, and which setting said so: named in its error.
_timeout_in_force: dict[str, Any] = {"seconds": DEFAULT_INIT_TIMEOUT_S, "name": "DIST_INIT_TIMEOUT_S"}


class DistInitError(RuntimeError):
    """The process group could not be formed; the message says what happened in words."""


@dataclass(frozen=True)
class DistConfig:
    backend: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S  # every collective after the first optimizer step (set_collective_timeout)
    init_method: str = "env://"
    init_timeout_s: float | None = None  # set-up, until the first optimizer step ends; None: timeout_s throughout

    @property
    def setup_timeout_s(self) -> float:
        return self.timeout_s if self.init_timeout_s is None else self.init_timeout_s


@dataclass(frozen=True)
class DistContext:
    """What a process needs to know once the group exists."""

    env: DistEnv
    backend: str
    device: torch.device
    store: dist.Store | None = None  # this attempt's key-value store, shared by every rank
    attempt: int = 1  # 1, then 2, 3... each time torchrun restarts the workers of this job (any reason)
    network: NetworkChoice | None = None  # the interface the backend uses between nodes (None on one node)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


def resolve_backend(requested: str, env: DistEnv) -> tuple[str, torch.device]:
    """Pick the backend and this process's device; every impossible combination is a ConfigError."""
    if requested not in BACKENDS:
        raise ConfigError(f"BACKEND={requested!r} is not supported: use one of {', '.join(BACKENDS)}")
    if requested == "gloo":
        return "gloo", torch.device("cpu")  # CPU on purpose: no GPU check applies
    if not torch.cuda.is_available():
        # A driver that sees GPUs torch cannot use (too old for the wheel's CUDA) must not become a silent CPU run.
        cuda.refuse_unusable_driver()
        if requested == "nccl":
            raise ConfigError("BACKEND=nccl needs a CUDA GPU but none is visible: use BACKEND=gloo (or auto) on CPU")
        return "gloo", torch.device("cpu")
    visible = torch.cuda.device_count()
    if env.local_world_size > visible:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={env.local_world_size} processes on this node but only {visible} GPU(s) visible "
            f"with BACKEND=nccl: use --nproc-per-node={visible} (or check CUDA_VISIBLE_DEVICES)"
        )
    cuda.refuse_unsupported_gpus([env.local_rank])  # each rank checks the GPU it will use
    return "nccl", torch.device("cuda", env.local_rank)


def init_method_problem(value: str) -> str | None:
    """Why ``value`` is no init method ddp-lab can use, or None (a host name resolves later, in ``validate``)."""
    url = urlparse(value)
    if url.scheme not in ("env", "tcp", "file"):
        return "is not supported"
    if url.scheme == "tcp":
        try:
            port = url.port
        except ValueError:
            port = None
        if not url.hostname or port is None or not 1 <= port <= 65535:
            return "needs a host and a port in 1-65535"
    if url.scheme == "file" and not url.path:
        return "has no path"
    return None


def validate(config: DistConfig, env: DistEnv) -> tuple[str, torch.device]:
    """Every check that can run before init; raises ConfigError."""
    if not config.timeout_s > 0:
        raise ConfigError(
            f"DIST_TIMEOUT_S={config.timeout_s} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S:g})"
        )
    if config.init_timeout_s is not None and not config.init_timeout_s > 0:
        raise ConfigError(
            f"DIST_INIT_TIMEOUT_S={config.init_timeout_s} must be a positive number of seconds "
            f"(default {DEFAULT_INIT_TIMEOUT_S:g})"
        )
    backend, device = resolve_backend(config.backend, env)
    problem = init_method_problem(config.init_method)
    if problem:
        raise ConfigError(
            f"INIT_METHOD={config.init_method!r} {problem}: use env://, tcp://HOST:PORT or file:///PATH (a file every "
            "rank can see)"
        )
    scheme = urlparse(config.init_method).scheme
    if scheme == "env" and (env.is_distributed or env.agent_store):
        env.require_master()
    if scheme == "tcp":
        _tcp_address(config.init_method)
    return backend, device


def _tcp_address(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)  # checked by init_method_problem
    check_resolves(url.hostname, url.port, "INIT_METHOD host")
    return url.hostname, url.port


def _first_contact(config: DistConfig, env: DistEnv) -> tuple[str, int] | None:
    """The address every node connects to first: the one whose route names this node's interface."""
    url = urlparse(config.init_method)
    if url.scheme == "tcp":
        return _tcp_address(config.init_method)
    if url.scheme == "env" and env.master_addr and env.master_port:
        return env.master_addr, env.master_port
    return None  # file://: no host to route to


def _create_store(config: DistConfig, env: DistEnv) -> tuple[dist.Store, str]:
    """The rendezvous store, and a description of it for error messages."""
    url = urlparse(config.init_method)
    timeout = timedelta(seconds=config.setup_timeout_s)
    if url.scheme == "file":
        return dist.FileStore(url.path, env.world_size), f"file {url.path}"
    if url.scheme == "env":
        if not env.is_distributed and not env.agent_store:
            return dist.HashStore(), "an in-process store"
        host, port = env.require_master()
        hosted_by_agent = env.agent_store
    else:
        host, port = _tcp_address(config.init_method)
        hosted_by_agent = env.agent_store and (host, port) == (env.master_addr, env.master_port)
    is_host = not hosted_by_agent and env.rank == 0
    try:
        store = dist.TCPStore(host, port, is_master=is_host, timeout=timeout, wait_for_workers=False)
    except Exception as error:  # torch raises several types (DistNetworkError, DistStoreError, RuntimeError)
        text = str(error)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise DistInitError(
                f"port {port} on {host} is already in use (another job, or two processes started with RANK=0): "
                "choose another MASTER_PORT"
            ) from error
        raise DistInitError(
            f"rank 0 unreachable at {host}:{port} within {config.setup_timeout_s:g} seconds: is rank 0 running, and is "
            f"{host}:{port} reachable from this host (firewall, MASTER_ADDR)? "
            f"({text.splitlines()[0] if text else type(error).__name__})"
        ) from error
    return store, f"{host}:{port}"


def _wait_for_all_ranks(
    store: dist.Store, env: DistEnv, timeout_s: float, where: str, problem: str | None = None
) -> list[dict[str, str]]:
    """Count who joined, so a missing rank is named, not a store timeout. A rank that cannot start still joins
    and posts its ``problem``; returns what such ranks said."""
    if store.add(f"rank/{env.rank}", 1) > 1:
        raise DistInitError(
            f"two processes claim RANK={env.rank} at {where}: another job may be using this port, or RANK is set twice"
        )
    if problem is not None:
        store.set(f"problem/{env.rank}", json.dumps({"host": socket.gethostname(), "message": problem}))
        store.add("problems", 1)  # before joining: when every rank has joined, every problem is posted
    if store.add("joined", 1) == env.world_size:
        store.set("all_joined", "1")
    try:
        store.wait(["all_joined"], timedelta(seconds=timeout_s))
    except Exception as error:
        try:
            missing = [r for r in range(env.world_size) if not store.check([f"rank/{r}"])]
        except Exception:  # the store's host (rank 0) timed out first and is gone
            raise DistInitError(
                f"not all of {env.world_size} ranks joined at {where} within {timeout_s:g} seconds, and the store "
                "closed before the missing ranks could be named (rank 0's error names them): start them, or check "
                "that they reach it"
            ) from error
        joined = env.world_size - len(missing)
        raise DistInitError(
            f"only {joined} of {env.world_size} ranks joined at {where} within {timeout_s:g} seconds "
            f"(missing ranks: {', '.join(map(str, missing))}): start them, or check that they reach {where}"
        ) from error
    if store.add("problems", 0) == 0:
        return []
    said = [
        dict(json.loads(store.get(f"problem/{r}")), rank=str(r))
        for r in range(env.world_size)
        if store.check([f"problem/{r}"])
    ]
    # Everyone has read them before anyone leaves: a failing rank's exit can take the store down with it.
    if store.add("problems_read", 1) == env.world_size:
        store.set("problems_all_read", "1")
    with contextlib.suppress(Exception):
        store.wait(["problems_all_read"], timedelta(seconds=timeout_s))
    return said


def _refuse_together(said: list[dict[str, str]], env: DistEnv, own: NodeConfigError | None) -> None:
    """Every rank stops with exit 2 when any node cannot start; each node prints one line."""
    if own is not None:
        raise own
    if said:
        first = said[0]
        node = int(first["rank"]) // env.local_world_size
        others = len({int(p["rank"]) // env.local_world_size for p in said}) - 1
        more = f" (and {others} more node(s))" if others else ""
        raise NodeConfigError(f"node {node} ({first['host']}) cannot start{more}: {first['message']}")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout in force; the message names the ranks that did not arrive."""


class PeerExitedError(RuntimeError):
    """Another rank's process went away during a collective: that rank's own error is the cause."""


PEER_EXIT_GRACE_S = 3.0  # long enough for torchrun (polling every 0.1 s) to see the culprit's exit first
TIMEOUT_ROLL_CALL_S = 5.0  # how long ranks that timed out wait for each other before naming the missing


def explain_collective_failure(error: RuntimeError, store: dist.Store, env: DistEnv, timeout_s: float) -> None:
    """Raise a clearer error for a collective another rank made fail (a timeout names the ranks that did not
    arrive; a peer's exit waits so torchrun blames the rank that crashed); return for anything else."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        stacks.record_timeout(error, flight_recorder.describe(flight_recorder.last_collective()))
        raise CollectiveTimeoutError(_name_ranks_that_did_not_arrive(store, env, timeout_s)) from error
    if any(sign in text for sign in ("connection closed by peer", "connection reset", "broken pipe")):
        wait_for_the_launcher(PEER_EXIT_GRACE_S)  # not synchronisation: yields the blame to the rank that crashed
        raise PeerExitedError(
            f"rank {env.rank}: another rank's process exited during a collective; its own error (the root cause "
            "in torchrun's summary) says why"
        ) from error


# SIGTERM came while training and the run's stop handler took it (ddp_core.process.preemption), then the run
# failed before it could stop for it: the launcher's signal, already here.
launcher_signalled = threading.Event()


def wait_for_the_launcher(seconds: float) -> None:
    """Sleep ``seconds``, or until torchrun's SIGTERM (it has seen the culprit fail); at once if the stop handler
    took that SIGTERM already (``launcher_signalled``): the launcher sends no second one."""
    if launcher_signalled.is_set():
        launcher_signalled.clear()
        return
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        signal.sigtimedwait({signal.SIGTERM}, seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def set_collective_timeout(seconds: float) -> None:
    """From now on every collective of the default group fails after ``seconds`` (docs/decisions.md, "Two timeouts")."""
    if dist.is_initialized():
        # torch before 2.12 (a GPU box's own install, say) has only the private form of the same call.
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(timedelta(seconds=seconds))
    _timeout_in_force.update(seconds=seconds, name="DIST_TIMEOUT_S")


def _name_ranks_that_did_not_arrive(store: dist.Store, env: DistEnv, timeout_s: float) -> str:
    """The one line a timed-out collective raises: the ranks that did not arrive, and where the others were."""
    head = f"rank {env.rank}: a collective timed out after {timeout_s:g} seconds ({_timeout_in_force['name']})"
    dumped = flight_recorder.dump(env.rank)
    fix = (
        "each rank's recent collectives: " + str(dumped)[: -len(str(env.rank))] + "N"
        if dumped
        else "TORCH_DISTRIBUTED_DEBUG=DETAIL names mismatched collectives"
    ) + " (docs/faults.md: Finding a hang)"
    roll_call = min(TIMEOUT_ROLL_CALL_S, timeout_s)
    keys = [f"timed_out/{r}" for r in range(env.world_size)]
    try:
        store.set_timeout(timedelta(seconds=roll_call))
        store.set(keys[env.rank], json.dumps(flight_recorder.last_collective()))
        deadline = time.monotonic() + roll_call  # polled: a store.wait that times out prints 2 C++ warnings a rank
        while not store.check(keys) and time.monotonic() < deadline:  # ends early when every rank timed out too
            time.sleep(0.05)
        arrived = {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}
    except Exception:  # the store's host is the rank that is gone
        return f"{head}; the store went away too, so the missing ranks cannot be named: {fix}"
    missing = [r for r in range(env.world_size) if r not in arrived]
    where, places = flight_recorder.where_ranks_were(arrived)
    if env.rank != min(arrived):  # not synchronisation: the lowest rank that arrived fails first, torchrun's root cause
        time.sleep(PEER_EXIT_GRACE_S)
    if not missing:
        why = (
            "the ranks called different collectives"
            if places > 1
            else "the network between them failed, or a collective is stuck"
        )
        return f"{head} on every rank: {why} ({where}); {fix}"
    return (
        f"{head}: rank(s) {', '.join(map(str, missing))} did not arrive (hung, died, or called another collective); "
        f"the others waited: {where}; {fix}"
    )


def _attempt_store(base_store: dist.Store, env: DistEnv) -> tuple[dist.Store, int]:
    """A key namespace of this attempt's own, the same on every rank of it: this rank's join count, or the
    elastic round ``DDP_LAB_RDZV_ROUND`` (docs/decisions.md, "Process group")."""
    rdzv_round = rendezvous_round()
    if rdzv_round is not None:
        return dist.PrefixStore(f"ddp_lab/round_{rdzv_round}", base_store), rdzv_round + 1
    generation = base_store.add(f"ddp_lab/joins/rank_{env.rank}", 1)
    return dist.PrefixStore(f"ddp_lab/generation_{generation}", base_store), generation


BeforeInit = Callable[[dist.Store, DistEnv, NetworkChoice | None, str | None], None]


@contextlib.contextmanager
def process_group(
    config: DistConfig = DistConfig(), env: DistEnv | None = None, before_init: BeforeInit | None = None
) -> Iterator[DistContext]:
    """Create the default process group and always destroy it. ``before_init(store, env, choice, problem)`` runs
    on every rank once all have joined, before a node that cannot choose its network stops them all (preflight)."""
    env = env or DistEnv.from_environ()
    backend, device = validate(config, env)
    choice, problem = _choose_network(config, env, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL and every later CUDA call use this GPU
    flight_recorder.enable(backend)
    if backend == "nccl":
        stacks.on_abort()  # NCCL's watchdog aborts a rank whose collective timed out: its stacks for the report
    base_store, where = _create_store(config, env)
    store, attempt = _attempt_store(base_store, env)
    try:
        joined = joining()  # a --heal replacement: its peers train on; its group forms at its first quorum
        said = (
            [] if joined else _wait_for_all_ranks(store, env, config.setup_timeout_s, where, problem and str(problem))
        )
        if before_init is not None and not joined:
            before_init(store, env, choice, str(problem) if problem else None)
        _refuse_together(said, env, problem)
        network.apply(choice, os.environ)
        if choice is not None and env.local_rank == 0 and not joined:  # once per node
            print(
                f"network: node {network.node_of(env, os.environ)} ({socket.gethostname()}): {choice.describe()}",
                flush=True,
            )
        if not joined:
            _init_group(config, env, backend, device, store, where)
        try:
            yield DistContext(env=env, backend=backend, device=device, store=store, attempt=attempt, network=choice)
            # Every rank leaves together: tearing down while another still works aborted at exit under load
            # ("terminate called without an active exception"). Not on an exception: the others might never come.
            if env.is_distributed:
                dist.barrier()
        except RuntimeError as error:  # collectives and stores raise RuntimeError (DistError) subclasses
            if env.is_distributed:
                explain_collective_failure(error, store, env, _timeout_in_force["seconds"])
            raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def regroup(ctx: DistContext, prefix: str) -> None:
    """The default group formed again, by every rank, under keys of ``prefix`` (--heal: once per quorum)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    assert isinstance(ctx.store, dist.PrefixStore)  # the attempt's: the job's store is under it, the same for all
    store = dist.PrefixStore(prefix, ctx.store.underlying_store)
    timeout = timedelta(seconds=_timeout_in_force["seconds"])
    device_id = ctx.device if ctx.device.type == "cuda" else None
    dist.init_process_group(
        ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout, device_id=device_id
    )


def _choose_network(config: DistConfig, env: DistEnv, backend: str) -> tuple[NetworkChoice | None, Exception | None]:
    """The interface between nodes, or the problem that keeps this node from choosing one (said to every rank)."""
    try:
        return network.choose(env, backend, os.environ, _first_contact(config, env)), None
    except network.NoRouteError:
        raise  # the store lies beyond that missing route too: nothing to wait for
    except NodeConfigError as error:
        return None, error


def _init_group(
    config: DistConfig, env: DistEnv, backend: str, device: torch.device, store: dist.Store, where: str
) -> None:
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=config.setup_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except Exception as error:
        raise DistInitError(f"process group init ({backend}) failed on rank {env.rank} at {where}: {error}") from error
    timeout_name = "DIST_TIMEOUT_S" if config.init_timeout_s is None else "DIST_INIT_TIMEOUT_S"
    _timeout_in_force.update(seconds=config.setup_timeout_s, name=timeout_name)


def rank() -> int:  # a --heal replacement's set-up (no group yet): the launcher's
    return dist.get_rank() if dist.is_initialized() else DistEnv.from_environ().rank if joining() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else DistEnv.from_environ().world_size if joining() else 1


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and/or torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# torch 2.14 renamed DDP's per-forward buffer sync (broadcast_buffers is deprecated there, with a warning)
BUFFER_SYNC_OPTION = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


def _forward_of_its_class(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(self).forward(self, *args, **kwargs)  # a frame of ddp_core's: see compilable_inside_ddp


# A bound method pickles as its object's attribute of this name: a whole model saved by torch.save loads again.
_forward_of_its_class.__name__ = "forward"


def compilable_inside_ddp(model: nn.Module) -> nn.Module:
    """``model`` with a forward of ddp_core's calling its class's where that is torch's code (``nn.Sequential``):
    Dynamo never starts tracing at a frame of torch's, so it ran eagerly inside a compiled DDP model."""
    forward = vars(model).get("forward", type(model).forward)  # an instance's own forward first
    if getattr(forward, "__func__", forward).__module__.startswith("torch."):
        model.forward = types.MethodType(_forward_of_its_class, model)
    return model


def wrap_ddp(model: nn.Module, ctx: DistContext, **options: Any) -> nn.parallel.DistributedDataParallel:
    """Move the model to this process's device and wrap it in DDP (``options`` are DDP's own)."""
    model = compilable_inside_ddp(model.to(ctx.device))
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    if ctx.world_size == 1:
        # DDP would still broadcast the buffers from rank 0 to itself before every forward: a collective per step.
        options.setdefault(BUFFER_SYNC_OPTION, False)
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)
