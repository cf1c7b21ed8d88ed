"""ddp_core.torchrun's elastic agent, built from torch's public pieces: nothing of torch's is replaced.

Its additions live in the hooks ``SimpleElasticAgent`` leaves to subclasses (``LabAgent``) and in a rendezvous
handler that delegates to torch's (docs/decisions.md, "The launcher").
"""

from __future__ import annotations

import inspect
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from ddp_core.distributed import stacks
from ddp_core.distributed.env import RDZV_ROUND_VARIABLE
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.process import heal, heartbeat, timeline, warm
from ddp_core.process.orphans import LAUNCHER_PID_VARIABLE

SHUTDOWN_TIMEOUT_DEFAULT_S = 30  # torch's, for TORCH_ELASTIC_SHUTDOWN_TIMEOUT
FAILED_JOB_GRACE_S = 3  # after a worker failed, the others' grace between SIGTERM and SIGKILL
GRACE_POLL_S = 0.05  # how often the grace's end looks whether the closed workers are gone
closed_by_this_launcher: set[int] = set()  # pids of workers this launcher ended: followers, not the cause


def failed_job_grace_s() -> float | None:
    """``FAILED_JOB_GRACE_S``, or less where ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says less; None: torch's own way."""
    try:
        seconds = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_DEFAULT_S))
    except ValueError:
        return None
    return None if seconds < 0 else min(FAILED_JOB_GRACE_S, seconds)


def refused_by_every_worker(failures: dict[int, ProcessFailure]) -> bool:
    """Every failed worker exited with the configuration error's code, or was closed by torchrun after one did."""
    codes = {failure.exitcode for failure in failures.values()}
    return CONFIG_ERROR_EXIT_CODE in codes and codes <= {CONFIG_ERROR_EXIT_CODE, -signal.SIGTERM}


def close_after_a_failure(handlers: dict[int, Any], grace_s: float) -> None:
    """When a worker has failed, take a hang's stacks, SIGTERM the others, and SIGKILL those alive ``grace_s`` later.

    torch's watch would wait a fixed 30 s for a hung rank, and the others can no longer finish a step anyway.
    Those closed are noted: followers, not the cause.
    """
    codes = [handler.proc.poll() for handler in handlers.values()]
    if not any(code not in (None, 0) for code in codes):
        return
    job_dir = os.environ.get(heartbeat.JOB_DIR_ENV)
    if job_dir:  # a hang: each worker's stacks first (ddp_core.distributed.stacks)
        stacks.gather(job_dir, heartbeat.run_dir(job_dir), codes)
    alive = [handler for handler, code in zip(handlers.values(), codes) if code is None]
    if not alive:
        return
    timeline.mark("closing")  # bench.recovery: a failure seen, the other workers are stopped from here
    closed_by_this_launcher.update(handler.proc.pid for handler in alive)
    for handler in alive:
        handler.close(death_sig=signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(handler.proc.poll() is None for handler in alive):
        time.sleep(GRACE_POLL_S)  # a deadline, not a synchronisation: the workers leave when they can
    for handler in alive:
        if handler.proc.poll() is None:
            handler.close(death_sig=signal.SIGKILL)


class LabAgent(LocalElasticAgent):
    """torch's local agent; each hook calls torch's own and adds one thing:

    - ``_monitor_workers``: a failed worker's peers are closed within ``FAILED_JOB_GRACE_S``; a group that failed
      with exit 2 in every worker is not restarted (the refusal would come back identical).
    - ``_shutdown``: a stop torchrun was asked for (Ctrl-C) reaches the workers as SIGTERM.
    - ``_rendezvous``: the workers get ``DDP_LAB_RDZV_ROUND``, the c10d round, to key their store by (unset: static),
      and under --heal the lighthouse's address (process.heal), group rank 0's agent serving it.
    - under ``DDP_LAB_TIMELINE`` (bench.recovery) it notes when it saw a failure, stopped and started workers.
    """

    def _monitor_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> RunResult:
        grace_s = failed_job_grace_s()
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None)
        if grace_s is not None and handlers:
            close_after_a_failure(handlers, grace_s)
        result = super()._monitor_workers(worker_group, *args, **kwargs)
        if result.state == WorkerState.FAILED and refused_by_every_worker(result.failures):
            self._stop_workers(worker_group)
            worker_group.state = WorkerState.FAILED
            raise ChildFailedError(name=worker_group.spec.get_entrypoint_name(), failures=result.failures)
        return result

    lab_lighthouse: Any = None  # under --heal, group rank 0's agent's (process.heal)

    def _rendezvous(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        super()._rendezvous(worker_group, *args, **kwargs)
        if heal.budget():
            self.lab_lighthouse = heal.meet_at_the_lighthouse(worker_group, self.lab_lighthouse)
        handler = worker_group.spec.rdzv_handler
        number = handler.round() if isinstance(handler, EveryRoundStore) else None
        if number is None:
            os.environ.pop(RDZV_ROUND_VARIABLE, None)
        else:
            os.environ[RDZV_ROUND_VARIABLE] = str(number)  # the workers inherit the agent's environment

    def _restart_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        timeline.mark("failure_seen", restart=self.lab_restart(worker_group))
        super()._restart_workers(worker_group, *args, **kwargs)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        super()._stop_workers(worker_group, *args, **kwargs)
        timeline.mark("stopped", restart=self.lab_restart(worker_group), job_dir=os.environ.get(heartbeat.JOB_DIR_ENV))

    def _start_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> dict[int, Any]:
        os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())  # each worker dies with this process (process.orphans)
        started = super()._start_workers(worker_group, *args, **kwargs)
        timeline.mark("spawned", restart=self.lab_restart(worker_group), job_dir=os.environ.get(heartbeat.JOB_DIR_ENV))
        return started

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
        # Each worker has a session of its own, so a Ctrl-C reaches this process only, and torch would pass the
        # SIGINT on. SIGTERM instead: a worker still importing or setting up (before its GracefulStop) ends quietly
        # by its default action, where SIGINT printed a KeyboardInterrupt traceback; one that is training stops
        # after its step, as for SIGINT.
        super()._shutdown(signal.SIGTERM if death_sig == signal.SIGINT else death_sig, *args, **kwargs)

    def lab_restart(self, worker_group: WorkerGroup) -> int:
        """Which restart this is (0: the first group), as torch counts it for TORCHELASTIC_RESTART_COUNT."""
        spec = worker_group.spec
        return spec.max_restarts - getattr(self, "_remaining_restarts", spec.max_restarts)


class EveryRoundStore(RendezvousHandler):
    """torch's rendezvous handler, except that under c10d rank 0 writes the workers' store address in every round,
    not only a node's first: a node joining later would wait for it (docs/decisions.md, "Several hosts").
    """

    def __init__(self, inner: RendezvousHandler) -> None:
        self.inner = inner

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        if not self.inner.use_agent_store:
            return info
        store = info.store
        if info.rank == 0:
            where = info.bootstrap_store_info
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, where.master_addr.encode())
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(where.master_port).encode())
            return info
        where = RendezvousStoreInfo(
            master_addr=store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode(),
            master_port=int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode()),
        )
        return RendezvousInfo(store, info.rank, info.world_size, where)

    def round(self) -> int | None:
        """The c10d round the last rendezvous formed (a private read of torch's handler); None under static."""
        state = getattr(getattr(self.inner, "_state_holder", None), "state", None)
        number = getattr(state, "round", None)
        return number if isinstance(number, int) else None

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def get_backend(self) -> str:
        return self.inner.get_backend()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


def _accepted(call: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``call`` takes: the GPU machines run an older torch, whose classes take fewer."""
    names = inspect.signature(call).parameters
    return {name: value for name, value in values.items() if name in names}


def _static_master(params: RendezvousParameters) -> tuple[str | None, int | None]:
    """Where static rendezvous's workers meet (its endpoint); other backends learn it in the rendezvous."""
    if params.backend != "static":
        return None, None
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    return host, port


def launch_agent(config: LaunchConfig, entrypoint: str, args: list[str]) -> None:
    """torchrun's ``launch_agent``, building ``LabAgent`` (without torch's early health-check server, off by
    default); raises ``ChildFailedError`` when the workers failed."""
    config.run_id = config.run_id or str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _static_master(params)
    if getattr(config, "signals_to_handle", None):  # what torch's launch_agent sets (torch 2.11's config lacks it)
        os.environ.update(TORCHELASTIC_SIGNALS_TO_HANDLE=config.signals_to_handle)
    handler = EveryRoundStore(rendezvous_registry.get_rendezvous_handler(params))
    shared = {field.name for field in fields(WorkerSpec)} & {field.name for field in fields(LaunchConfig)}
    restarts = config.max_restarts or heal.budget()  # under --heal torch's are 0: the clients replace a worker
    client = warm.client_args(entrypoint, args, restarts, getattr(config, "numa_options", None) is not None)
    spec = WorkerSpec(
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(client or args),
        rdzv_handler=handler,
        master_addr=master_addr,
        master_port=master_port,
        **{name: getattr(config, name) for name in shared},
    )
    agent = LabAgent(spec=spec, **_accepted(LabAgent.__init__, vars(config)))
    shutdown_rendezvous = True
    stop_warm_parent = warm.start() if client and warm.forks(args) else None  # restarted workers fork from it
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=spec.get_entrypoint_name(), failures=result.failures)
    except ChildFailedError:
        raise
    except SignalException:
        shutdown_rendezvous = False  # as torch: a signalled agent leaves the rendezvous open for other nodes
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        os.environ.pop(LAUNCHER_PID_VARIABLE, None)  # the workers' variable, not this process's
        if stop_warm_parent is not None:
            stop_warm_parent()
        if agent.lab_lighthouse is not None:
            agent.lab_lighthouse.shutdown()
        if shutdown_rendezvous:
            handler.shutdown()
