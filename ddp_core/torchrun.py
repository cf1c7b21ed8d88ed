"""torchrun, with one plain sentence instead of a traceback when the nodes never meet or a stop was asked for.

    python -m ddp_core.torchrun [torchrun's arguments]       # what the container's entrypoint runs

torchrun's agents meet (rendezvous) before any worker starts, so ddp_core's own join check never runs
when a whole node is missing: the user would see a store traceback ("1/2 clients joined", a socket
timeout, a key that never came, or a bare RendezvousTimeoutError). This runs torchrun's own ``main`` in
this process (signals reach it as they would reach torchrun) and turns those failures into one line
naming the missing node, the endpoint, the timeout and the fix, on every node that started.

To know which node is missing, each agent signs a roll call in the rendezvous store as soon as it
reaches it (``RollCall``: its node rank under static rendezvous, its host name), and keeps a copy of
who else signed. Under c10d rendezvous a node has no rank until every node has joined, so the missing
one is named by what is absent: how many, and who did join.

Under c10d rendezvous, torchrun lets the agent on the endpoint's host serve the store, and finds that
host by comparing the endpoint with this host's *name* and the addresses it resolves to. Where the name
resolves to 127.0.1.1 (Debian, Ubuntu), no agent recognises the endpoint's IP as its own, none serves
the store, and every node waits 60 s to fail. Here the agent whose interface holds the endpoint's address
is told to serve it, through c10d's own option ``is_host`` (``serve_the_c10d_store_here``).

A stop signal (``docker stop``, Slurm, Ctrl-C) makes plain torchrun exit 1 with a SignalException
traceback, as if the job had failed. Here it exits ``STOPPED_EXIT_CODE`` (143) with one line, as the
workers do after their checkpoint (ddp_core.process.preemption).

When a worker fails, torchrun stops the others and SIGKILLs those still alive 30 s later, whatever
TORCH_ELASTIC_SHUTDOWN_TIMEOUT says; here that grace is TORCH_ELASTIC_SHUTDOWN_TIMEOUT too, so a job with
a hung rank ends when the user said it would.

torchrun starts each worker in a session of its own; killed by SIGKILL (``kill -9``, the out-of-memory
killer), it left them training on as orphans, holding the port and the GPUs. Here the kernel kills every
worker when this process dies (``workers_die_with_this_launcher``, ddp_core.process.orphans).
A configuration error (every worker exits 2, ddp_core.errors.ConfigError: a refused resume, a bad flag) is
not retried: torchrun would spend every ``--max-restarts`` on a refusal that cannot change, each restart
printing it again. Here the agent stops at once (``LabAgent``).

Under c10d rendezvous with a node range (``--nnodes=MIN:MAX``) the workers are told so
(``DDP_LAB_NNODES_RANGE``): a restart at another world size then continues the run instead of refusing it
(ddp_core.output.run). They are also told the rendezvous round they were started for
(``DDP_LAB_RDZV_ROUND``, ``LabAgent``), which every node of the round agrees on, where the
workers' own count of their joins differs once a node joins later or is gone (ddp_core.distributed.group).
torchrun's agents learn where the workers' store is (rank 0's agent serves it) in their first round only, so a
node joining a later round waited for an address no agent wrote again; here rank 0 writes it in every round
(``every_round_names_the_workers_store``).
The agent's additions live in a subclass of torch's agent (``LabAgent``), in the methods torch's
``SimpleElasticAgent`` leaves to subclasses; torchrun's ``launch_agent`` has no parameter for the agent's
class, so the public name it builds the agent from is pointed at ``LabAgent`` while ``main`` runs. No private
attribute of torch is written: its private state is only read, where present.
torch's rendezvous names the caller of each event it records with ``inspect.stack()``, a slow call; here the same
name comes from the frame (``rendezvous_events_name_their_caller_cheaply``).
Everything else is torchrun's, unchanged.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist
import torch.distributed.run as torch_run
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher import api as launcher_api

from ddp_core.distributed.env import NNODES_RANGE_VARIABLE, RDZV_ROUND_VARIABLE
from ddp_core.distributed.network import is_local_address, is_loopback, reachable_address
from ddp_core.errors import ConfigError
from ddp_core.exit_codes import (
    CONFIG_ERROR_EXIT_CODE,
    DIVERGED_EXIT_CODE,
    FAILED_EXIT_CODE,
    PREFLIGHT_FAILED_EXIT_CODE,
    REPLICAS_DIVERGED_EXIT_CODE,
    STOPPED_EXIT_CODE,
    STORAGE_EXIT_CODE,
)
from ddp_core.process import failure_report, heartbeat, spares, timeline
from ddp_core.process.orphans import die_with_parent

RENDEZVOUS_FAILED_EXIT_CODE = FAILED_EXIT_CODE
# How the agents' meeting fails: a timeout, a key that never came, a store that was never reached or went
# away, a rendezvous another node closed when it gave up.
RENDEZVOUS_FAILURES = (
    RendezvousTimeoutError,
    RendezvousClosedError,
    RendezvousConnectionError,
    DistStoreError,
    DistNetworkError,
)
# Workers that stop themselves for a reason they print in one line (ddp_core.errors.RunStoppedError) all
# exit with its code; the job exits with it too, instead of torchrun's 1 and its failure summary.
STATED_EXIT_CODES = (
    CONFIG_ERROR_EXIT_CODE,
    DIVERGED_EXIT_CODE,
    PREFLIGHT_FAILED_EXIT_CODE,
    REPLICAS_DIVERGED_EXIT_CODE,
    STORAGE_EXIT_CODE,
)


def _endpoint(args: Namespace) -> str:
    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return args.rdzv_endpoint


def _timeout(args: Namespace) -> float | None:
    match = re.search(r"(?:^|,)\s*(?:join_)?timeout\s*=\s*([0-9.]+)", args.rdzv_conf or "")
    return float(match.group(1)) if match else None


def _timeout_s(args: Namespace) -> str:
    seconds = _timeout(args)
    return f"{seconds:g} seconds" if seconds is not None else "torchrun's rendezvous timeout"


ROLL_CALL_DEFAULT_S = 600.0  # torchrun's own default for both rendezvous kinds
WATCH_STEP_S = 0.5  # how often the roll call looks for nodes that signed, and how long stopping it takes


class RollCall:
    """The nodes that reached the rendezvous store, as seen from this one (a thread and its own store client).

    Static rendezvous fixes every node's rank (--node-rank), so the missing one is named exactly; under
    c10d only the joined nodes' host names are known. Only keys of its own are written (``ddp_lab/roll_call/<id>/``),
    and the client adds nothing to the count torchrun's agents wait for.
    """

    def __init__(self, args: Namespace):
        self.static = args.rdzv_backend == "static"
        self.expected = torch_run.parse_min_max_nnodes(args.nnodes)[1]
        self.node_rank = args.node_rank if self.static else None
        self.prefix = f"ddp_lab/roll_call/{args.rdzv_id}"
        self.timeout_s = (_timeout(args) or ROLL_CALL_DEFAULT_S) + 60  # outlives the rendezvous it watches
        self.seen: list[dict[str, object]] = []
        self.stopping = threading.Event()
        host, _, port = _endpoint(args).rpartition(":")
        self.address = (host.strip("[]"), int(port) if port.isdigit() else 29400)
        self.thread = threading.Thread(target=self._watch, name="ddp_lab roll call", daemon=True)

    def start(self) -> "RollCall":
        if self.expected > 1:
            self.thread.start()
        return self

    def stop(self) -> None:
        """Before the process ends: a thread still inside a store call when Python finalizes aborts the process."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * WATCH_STEP_S)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._reachable():  # quietly: a store client would log every retry, as the agent already does
            if self.stopping.wait(WATCH_STEP_S) or time.monotonic() > deadline:
                return
        try:
            store = dist.TCPStore(
                *self.address, is_master=False, timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False
            )
            slot = store.add(f"{self.prefix}/count", 1)
            store.set(
                f"{self.prefix}/{slot}",
                json.dumps({"node_rank": self.node_rank, "host": socket.gethostname(), "pid": os.getpid()}),
            )
            index = 1
            while index <= self.expected and time.monotonic() < deadline:
                key = f"{self.prefix}/{index}"  # the next node to sign, in the order they reached the store
                if store.check([key]):  # not store.wait: a wait that times out logs a warning each time
                    self.seen.append(json.loads(store.get(key)))
                    index += 1
                elif self.stopping.wait(WATCH_STEP_S):
                    return
        except Exception:  # the store went away, or was never reached: what was seen is the answer
            return

    def _reachable(self) -> bool:
        try:
            socket.create_connection(self.address, timeout=WATCH_STEP_S).close()
        except OSError:
            return False
        return True

    def missing(self) -> str | None:
        """'node 2 (--node-rank=2)' or '1 of 3 nodes', or None when this node never reached the store or all came."""
        seen = list(self.seen)
        if not seen:
            return None
        if self.static:
            joined = {entry["node_rank"] for entry in seen}
            absent = [rank for rank in range(self.expected) if rank not in joined]
            if not absent:
                return None
            ranks = ", ".join(map(str, absent))
            return f"node {ranks} (--node-rank={ranks})" if len(absent) == 1 else f"nodes {ranks}"
        count = self.expected - len(seen)
        return f"{count} of {self.expected} nodes" if count > 0 else None

    def joined(self) -> str:
        if self.static:
            return ", ".join(
                f"node {e['node_rank']} ({e['host']})" for e in sorted(self.seen, key=lambda e: e["node_rank"])
            )
        return ", ".join(str(e["host"]) for e in self.seen)


def explain(error: BaseException, args: Namespace, roll_call: RollCall | None = None) -> str | None:
    """The one-line message for a rendezvous that failed, or None when ``error`` is something else."""
    where, within, nodes = _endpoint(args), _timeout_s(args), args.nnodes
    start_them = (
        f"start every node (NNODES={nodes}) with the same MASTER_ADDR/MASTER_PORT, and check that they reach "
        f"{where} (firewall, address)"
    )
    missing = roll_call.missing() if roll_call is not None else None
    if missing is not None and roll_call is not None and isinstance(error, RENDEZVOUS_FAILURES):
        one = missing.startswith("node ") or missing.startswith("1 of")
        start = (
            ("start it" if one else "start them")
            if roll_call.static
            else "start the missing node(s) with the same command"
        )
        return (
            f"{missing} never joined the rendezvous at {where} within {within} (joined: {roll_call.joined()}): "
            f"{start}, and check that {'it reaches' if one else 'they reach'} {where} (firewall, address)"
        )
    if isinstance(error, RendezvousClosedError):
        return (
            f"another node closed rendezvous {args.rdzv_id!r} at {where} (it gave up waiting): "
            f"its own error says why (NNODES={nodes})"
        )
    if isinstance(error, RendezvousConnectionError):
        return (
            f"lost the rendezvous store at {where}: the node serving it stopped or became unreachable; "
            f"its own error says why (NNODES={nodes})"
        )
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"the nodes did not all join rendezvous {args.rdzv_id!r} at {where} within {within} (NNODES={nodes}): "
            f"{start_them}"
        )
    text = str(error)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if isinstance(error, DistStoreError) and joined:
        return f"only {joined.group(1)} of {joined.group(2)} nodes joined at {where} within {within}: {start_them}"
    if isinstance(error, DistNetworkError) and "timed out" in text.lower():
        return (
            f"node 0 unreachable at {where} within {within}: is node 0 (NODE_RANK=0) running, and is {where} "
            "reachable from this host (firewall, MASTER_ADDR)?"
        )
    return None


C10D_DEFAULT_PORT = 29400  # torch's, for a c10d endpoint without a port
PROBE_TIMEOUT_S = 1.0


def _named_as_this_host(host: str) -> bool:
    """What torch's c10d backend guesses when --rdzv-conf has no ``is_host``: ``localhost``, a loopback address,
    this host's name or canonical name, or an address this host's name resolves to. Where it guesses so, an agent
    that finds the port taken (another agent on this host serves it) becomes a client."""
    this_host = socket.gethostname()
    if host in ("localhost", this_host):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        theirs = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError, ValueError):
        theirs = set()
    try:
        ours = socket.getaddrinfo(this_host, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME)
    except (OSError, UnicodeError, ValueError):
        return False
    return any(info[3] == host or info[4][0] in theirs for info in ours)


def _accepts_connections(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def serve_the_c10d_store_here(launch: Namespace) -> str:
    """``launch``'s --rdzv-conf, with ``is_host=1`` where this agent must serve the c10d store and torch would not.

    Under c10d rendezvous the agent on the endpoint's host serves the store. torch finds that host by comparing
    the endpoint with this host's *name* and the addresses it resolves to (``_named_as_this_host``); where the
    name resolves to 127.0.1.1 (Debian, Ubuntu), no agent recognises the endpoint's IP as its own, none serves the
    store, and every node waits 60 s to fail. Here, where the endpoint is an address of this host's interfaces,
    torch would not serve it, the user did not say (``is_host``), and nothing answers at the endpoint yet, this
    agent is told to serve it, through torch's own option. Where something answers there (another agent on this
    host serves it), torch's guess is left to decide: this agent joins as a client.

    The race that remains: two agents on one host, started at the same instant with an endpoint that is an
    interface's address, may both find the port free; both are told to serve it, and the second fails to bind
    (torch's own guess would have made it a client) and ends with the rendezvous error.
    """
    conf = launch.rdzv_conf or ""
    if launch.rdzv_backend != "c10d" or launch.standalone or not launch.rdzv_endpoint:
        return conf
    if "is_host" in {part.split("=", 1)[0].strip() for part in conf.split(",")}:
        return conf  # yours wins
    try:
        host, port = parse_rendezvous_endpoint(launch.rdzv_endpoint, default_port=C10D_DEFAULT_PORT)
    except ValueError:
        return conf  # torch refuses it next, with its own message
    if _named_as_this_host(host) or not is_local_address(host) or _accepts_connections(host, port):
        return conf
    return f"{conf},is_host=1" if conf.strip() else "is_host=1"


SHUTDOWN_TIMEOUT_DEFAULT_S = 30  # torch's, for TORCH_ELASTIC_SHUTDOWN_TIMEOUT


FAILED_JOB_GRACE_S = 3  # after a worker failed, the others' grace between SIGTERM and SIGKILL
closed_by_this_launcher: set[int] = set()  # pids of workers this launcher ended: followers, not the cause


def close_failed_jobs_within_the_shutdown_timeout() -> None:
    """When a worker fails, torchrun closes the others with SIGTERM and SIGKILLs them 30 s later, a figure
    fixed in torch (``PContext.close``'s default): ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` sets only the grace
    after a stop signal. A rank hung inside a step takes SIGTERM as a stop request for after that step, which
    never ends, so every job with a hung rank waited the 30 s. Here that path waits ``FAILED_JOB_GRACE_S``
    (3 s; less when ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says less): once a rank has failed the others cannot
    finish a step or write a checkpoint (their next collective fails), so a longer grace only delays the report.
    The workers alive at that moment are noted (``closed_by_this_launcher``): the report does not blame them.
    """
    try:
        seconds = min(
            FAILED_JOB_GRACE_S, int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_DEFAULT_S))
        )
    except ValueError:
        return
    if seconds < 0:
        return
    original = getattr(PContext.close, "ddp_lab_original", PContext.close)

    def close(self: PContext, death_sig: signal.Signals | None = None, timeout: int | None = None) -> None:
        timeline.mark("closing")  # bench.recovery: a failure seen, the other workers are stopped from here
        for handler in getattr(self, "subprocess_handlers", {}).values():
            if handler.proc.poll() is None:
                closed_by_this_launcher.add(handler.proc.pid)
        original(self, death_sig, seconds if timeout is None else timeout)

    close.ddp_lab_original = original  # type: ignore[attr-defined]
    PContext.close = close  # type: ignore[method-assign]


def workers_die_with_this_launcher() -> None:
    """Every worker torchrun starts from now on is SIGKILLed by the kernel when this process dies.

    This process is torchrun's agent: it starts the workers itself, with ``Popen`` from its main thread,
    and waits for them there. The request (``die_with_parent``) is made in each worker between fork and
    exec, so no worker runs a line without it.
    """
    original = getattr(subprocess_handler.Popen, "ddp_lab_original", subprocess_handler.Popen)

    def popen(*args: object, **kwargs: object) -> subprocess.Popen:
        if spares.enabled():  # a warm spare started with the same request, where one is waiting
            command, env = kwargs.get("args", args[0] if args else None), kwargs.get("env")
            spare = SPARES.take(command, env, stdout=kwargs.get("stdout"), stderr=kwargs.get("stderr"))  # type: ignore[arg-type]
            if spare is not None:
                return spare
        kwargs.setdefault("preexec_fn", partial(die_with_parent, os.getpid()))
        return original(*args, **kwargs)

    popen.ddp_lab_original = original  # type: ignore[attr-defined]
    subprocess_handler.Popen = popen  # type: ignore[misc]


def _refused_by_every_worker(failures: dict[int, ProcessFailure]) -> bool:
    """Every failed worker exited with the configuration error's code, or was closed by torchrun after one did."""
    codes = {failure.exitcode for failure in failures.values()}
    return CONFIG_ERROR_EXIT_CODE in codes and codes <= {CONFIG_ERROR_EXIT_CODE, -signal.SIGTERM}


SPARES = spares.Spares()  # DDP_LAB_WARM_SPARES: the next restart's workers, imported already


def _plain_popen() -> Callable[..., subprocess.Popen]:
    return getattr(subprocess_handler.Popen, "ddp_lab_original", subprocess_handler.Popen)


class LabAgent(LocalElasticAgent):
    """torch's local agent, with this launcher's additions in the methods torch's ``SimpleElasticAgent`` leaves
    to its subclasses (``_monitor_workers``, ``_start_workers``, ``_stop_workers``, ``_rendezvous``,
    ``_restart_workers``). Each calls torch's own and adds one thing; torch's private state is only read, and
    where it is absent the addition is left out (no restart number, no spares, no round).

    - A configuration error ends the job (``_monitor_workers``): a group that failed with exit 2 in every worker
      is not restarted, whatever --max-restarts says. torchrun's agent restarts a failed group while restarts
      remain; a refusal (another world size without a node range, another experiment's checkpoint, a bad flag)
      comes back identical each time, after a new rendezvous (30 s of c10d's last call on a node range). Here the
      agent stops the workers and ends the job with torch's own ``ChildFailedError``, as its run would after the
      last restart; ``main`` turns the shared code into exit 2 with the workers' one line. Every node's workers
      refuse together (rank 0 decides), so every agent stops.
    - Each worker group is started with ``DDP_LAB_RDZV_ROUND`` (``_rendezvous``): the c10d rendezvous round it was
      formed in. Every node of a round agrees on its number (the rendezvous state every agent syncs), and each
      restart is a new round, so the workers key their store by it (ddp_core.distributed.group). Static
      rendezvous has no rounds: the variable is left unset, and the workers count their joins as before.
    - With ``DDP_LAB_WARM_SPARES=1``, once a group has started and a restart remains, one warm spare per local
      worker waits for the next group (``_start_workers``, ddp_core.process.spares).
    - Under ``DDP_LAB_TIMELINE`` (bench.recovery) the agent notes when it saw a failure and restarts, when the
      old workers were stopped, and when the new ones were started (ddp_core.process.timeline).
    """

    def _monitor_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> RunResult:
        result = super()._monitor_workers(worker_group, *args, **kwargs)
        if result.state == WorkerState.FAILED and _refused_by_every_worker(result.failures):
            self._stop_workers(worker_group)
            worker_group.state = WorkerState.FAILED
            raise ChildFailedError(name=worker_group.spec.get_entrypoint_name(), failures=result.failures)
        return result

    def _rendezvous(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        super()._rendezvous(worker_group, *args, **kwargs)
        state = getattr(getattr(worker_group.spec.rdzv_handler, "_state_holder", None), "state", None)
        number = getattr(state, "round", None)
        if isinstance(number, int):
            os.environ[RDZV_ROUND_VARIABLE] = str(number)  # the workers inherit the agent's environment
        else:
            os.environ.pop(RDZV_ROUND_VARIABLE, None)

    def _restart_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        timeline.mark("failure_seen", restart=self.lab_restart(worker_group))
        super()._restart_workers(worker_group, *args, **kwargs)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        super()._stop_workers(worker_group, *args, **kwargs)
        timeline.mark("stopped", restart=self.lab_restart(worker_group), job_dir=os.environ.get(heartbeat.JOB_DIR_ENV))

    def _start_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> dict[int, Any]:
        started = super()._start_workers(worker_group, *args, **kwargs)
        # first: the time a group started is noted before its spares are
        timeline.mark("spawned", restart=self.lab_restart(worker_group), job_dir=os.environ.get(heartbeat.JOB_DIR_ENV))
        spec = worker_group.spec
        command = [str(arg) for arg in spec.args]
        if spares.enabled() and getattr(self, "_remaining_restarts", 0) > 0 and command[:2] == ["-u", "-m"]:
            SPARES.start(str(spec.entrypoint), command[2], spec.local_world_size, _plain_popen())
        return started

    def lab_restart(self, worker_group: WorkerGroup) -> int:
        """Which restart this is (0: the first group), as torch counts it for TORCHELASTIC_RESTART_COUNT."""
        spec = worker_group.spec
        return spec.max_restarts - getattr(self, "_remaining_restarts", spec.max_restarts)


def install_the_agent() -> Callable[[], None]:
    """torchrun's ``launch_agent`` builds ``LabAgent`` instead of torch's ``LocalElasticAgent``; returns the undo.

    ``launch_agent`` has no parameter for the agent's class: it takes the name ``LocalElasticAgent`` from its own
    module (``torch.distributed.launcher.api``) when it runs, so that public name is what is replaced, for the
    time of ``main``. Nothing of torch's classes is changed.
    """
    previous = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = LabAgent

    def undo() -> None:
        launcher_api.LocalElasticAgent = previous

    return undo


def every_round_names_the_workers_store() -> None:
    """Under c10d, rank 0's agent writes where the workers' store is in every round, and the other agents read it there.

    torchrun's c10d handler serves the workers' store from rank 0's agent and writes its address (``MASTER_ADDR``,
    ``MASTER_PORT``, among the round's keys) only in a node's first round; in later rounds each agent reuses what
    it learned then. A node that joins in a later round (a node range growing, a node started again) waits for
    those keys, which rank 0 never writes again, before it writes its own rank information, which rank 0 waits
    for: both time out after 60 s. And an agent that learned the address of a rank 0 since gone, or replaced by
    a node that sorts first, would send its workers to a store that is gone, or to a second one. Here rank 0
    writes the address in every round and every other rank takes it from that round. With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` each round already does so (the workers' rank 0 serves the store).
    """
    original = getattr(
        DynamicRendezvousHandler.next_rendezvous, "ddp_lab_original", DynamicRendezvousHandler.next_rendezvous
    )

    def next_rendezvous(self: DynamicRendezvousHandler) -> RendezvousInfo:
        info = original(self)
        if not self.use_agent_store:
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

    next_rendezvous.ddp_lab_original = original  # type: ignore[attr-defined]
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def rendezvous_events_name_their_caller_cheaply() -> None:
    """torch's rendezvous names the method behind each event it records with ``get_method_name``, which calls
    ``inspect.stack()`` twice: that reads the source file of every frame and searches ``sys.modules`` for each one's
    module. A launch records about ten events (a restart as many again): 0.15-0.3 s of CPU per launch on the 2-core
    machine, 0.7 s in a process with every module of the test suite's fork server loaded, half of a one-step toy
    run's there (docs/benchmarks.md, "What a launch costs"). The same name, from the frame itself."""
    original = getattr(dynamic_rendezvous.get_method_name, "ddp_lab_original", dynamic_rendezvous.get_method_name)

    def get_method_name(depth: int = 2) -> str:
        frame = sys._getframe(0)  # inspect.stack()[0], as in torch's
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                return "no_method_name"
        return frame.f_code.co_name

    get_method_name.ddp_lab_original = original  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name


def announce_the_node_range(args: Namespace) -> None:
    """``DDP_LAB_NNODES_RANGE=MIN:MAX`` for the workers under c10d with --nnodes=MIN:MAX (MIN < MAX), else unset:
    torchrun tells its workers the world size of each round, not that the user allowed it to change."""
    low, high = torch_run.parse_min_max_nnodes(args.nnodes)
    if args.rdzv_backend != "static" and not args.standalone and low < high:
        os.environ[NNODES_RANGE_VARIABLE] = f"{low}:{high}"
    else:
        os.environ.pop(NNODES_RANGE_VARIABLE, None)


def advertise_this_node(args: Namespace, argv: list[str]) -> list[str]:
    """c10d: tell the other nodes an address they reach, not the host name (torchrun's --local-addr default).

    Rank 0's agent gives its workers MASTER_ADDR = its --local-addr, else its fully qualified host name,
    which on a host whose name resolves to loopback sends every other node's workers to their own
    loopback, where they wait for the timeout. Here the default is the address of this host's interface
    that reaches the rendezvous endpoint (ddp_core.distributed.network); a --local-addr of yours wins.
    """
    if args.rdzv_backend != "c10d" or args.local_addr or args.standalone:
        return argv
    host, _, port = _endpoint(args).rpartition(":")
    host = host.strip("[]")
    try:
        if all(is_loopback(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)):
            return argv  # an endpoint on loopback: every node is on this host
        choice = reachable_address(host, int(port) if port.isdigit() else 29400)
    except (ConfigError, OSError):
        return argv  # the agent's own connection attempt fails next, with its own message
    print(
        f"rendezvous: this node is {choice.address} to the others ({choice.interface}: "
        f"{choice.reason.split(';')[0]}); pass --local-addr to choose another",
        flush=True,
    )
    return [f"--local-addr={choice.address}", *argv]


def _shared_exit_code(error: ChildFailedError, code: int) -> bool:
    """Every worker exited with ``code``, or was ended by torchrun's SIGTERM after one did.

    Workers leave together (a barrier), but torchrun may see one exit first and SIGTERM the others while
    they are already in interpreter teardown, where Python's handlers are gone: -SIGTERM, after the
    checkpoint was written (before the barrier).
    """
    codes = {failure.exitcode for failure in error.failures.values()}
    return code in codes and codes <= {code, -signal.SIGTERM}


class _QuietStatedExits(logging.Filter):
    """Keeps the user's last line the one that says why, when the workers stopped for a stated reason or failed.

    Drops torch's "failed (exitcode: N)" line for a code whose one line a worker printed already (and the
    stopped exit, whose line this launcher prints). Workers raising the same error leave at nearly the same
    moment, but torchrun may see one exit first and close the others ("Sending process N closing signal
    SIGTERM"), a line that would land after the worker's one line. Those lines, and torch's lines about a
    failure (its "failed (exitcode: N)" and "Unable to shutdown" lines, the error handler's), are held until the
    job's end: dropped for a stated code, kept in the failure report's file when this launcher reports the failure
    (``forget``), printed otherwise. Every line held is kept in ``seen`` for that file.
    """

    _FAILED = re.compile(r"failed \(exitcode: (-?\d+)\)")
    _HELD = re.compile(r"^(Sending process \d+ closing signal |Unable to shutdown process |failed \(exitcode: )")

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.held: list[logging.LogRecord] = []
        self.seen: list[str] = []
        self.releasing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.releasing:
            return True
        message = record.getMessage()
        match = self._FAILED.search(message)
        if match is not None and int(match.group(1)) in (*STATED_EXIT_CODES, STOPPED_EXIT_CODE):
            self.held.clear()
            return False
        if self._HELD.match(message) or record.name.endswith("error_handler"):
            self.held.append(record)
            self.seen.append(f"{record.levelname} {record.name}: {message}")
            return False
        self.release()
        return True

    def release(self) -> None:
        """Print the held lines, in their order: the job did not end with a stated code, or is ending now."""
        held, self.held = self.held, []
        self.releasing = True
        try:
            for record in held:
                logging.getLogger(record.name).handle(record)
        finally:
            self.releasing = False

    def forget(self) -> None:
        """This launcher reported the failure: torch's lines are in the report's file, not on the console."""
        self.held.clear()


def _culprits(error: ChildFailedError) -> list[failure_report.RankFailure]:
    """The ranks that failed by themselves: not those this launcher closed after the first failure."""
    host = socket.gethostname()
    failures = [
        failure_report.RankFailure(
            rank=rank,
            host=host,
            exitcode=failure.exitcode,
            message=_message(failure),
            traceback=_callstack(failure.error_file_data),
        )
        for rank, failure in error.failures.items()
        if failure.pid not in closed_by_this_launcher
    ]
    if failures:
        return failures
    rank, failure = error.get_first_failure()
    return [failure_report.RankFailure(rank, host, failure.exitcode)]


def _message(failure: ProcessFailure) -> str:
    """ "ExceptionType: text" from the worker's error file (``@record``); empty for a worker that left none."""
    if not _has_error_file(failure):
        return ""
    message = failure.message
    return str(message.get("message", "")) if isinstance(message, dict) else str(message)


def _has_error_file(failure: ProcessFailure) -> bool:
    return bool(failure.error_file) and os.path.isfile(failure.error_file)


def _callstack(data: object) -> str:
    try:
        return str(data["message"]["extraInfo"]["py_callstack"])  # type: ignore[index]
    except (KeyError, TypeError):
        return ""


def report_failure(error: ChildFailedError, args: Namespace, job_dir: str, quiet: _QuietStatedExits) -> int:
    """One report for this node's failed workers (failure_report), torch's own output in a file; the exit code."""
    beats = heartbeat.read(job_dir)
    run_dir = next((beat.run_dir for beat in beats.values()), None)
    path = failure_report.report_path(run_dir, int(getattr(args, "node_rank", 0) or 0))
    tracebacks = [
        f"--- rank {rank} (exit code {failure.exitcode}), its error file {failure.error_file}:\n"
        + _callstack(failure.error_file_data)
        for rank, failure in sorted(error.failures.items())
        if _has_error_file(failure)
    ]
    kept = failure_report.keep_full_output(path, [*quiet.seen, str(error), *tracebacks])
    lines, code = failure_report.report(_culprits(error), beats, kept)
    quiet.forget()
    failure_report.print_report(lines)
    return code


def split_at_the_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's options and the training script, then the script's own arguments.

    torchrun's parser takes everything after the script as the script's, but argparse still reads each of those
    words first as a possible abbreviation of its own options: the experiments' ``--nproc 2`` after the script
    ends torchrun with "ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node". Only the
    part before the script is torchrun's to parse.
    """
    options = torch_run.get_args_parser()._option_string_actions
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":  # what follows is the script and its arguments
            return argv[: index + 2], argv[index + 2 :]
        if not word.startswith("-") or word == "-":
            return argv[: index + 1], argv[index + 1 :]
        name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
        found = [options[name]] if name in options else [a for o, a in options.items() if o.startswith(name)]
        takes_value = len({id(action) for action in found}) == 1 and found[0].nargs != 0
        attached = "=" in word or (not word.startswith("--") and len(word) > 2)
        index += 2 if takes_value and not attached else 1
    return argv, []


def errors_in_the_job_folder(launch: Namespace, job_dir: str) -> None:
    """Given no ``--log-dir``, torch makes a ``torchelastic_*`` folder in the temp folder per launch and leaves it
    there. Without ``--redirects`` or ``--tee`` it holds only the workers' error files, read before the launch
    ends: they go into this launch's own folder instead, removed with it. Redirected output stays where torch puts
    it, for the user to read."""
    if launch.log_dir is None and launch.redirects == "0" and launch.tee == "0":
        launch.log_dir = os.path.join(job_dir, "errors")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, script_args = split_at_the_script(argv)
    torch_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _QuietStatedExits(torch_log)
    torch_log.addFilter(quiet)
    error_log = logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler")
    error_log.addFilter(quiet)
    args = torch_run.parse_args(argv)
    roll_call = None if args.standalone else RollCall(args).start()
    close_failed_jobs_within_the_shutdown_timeout()
    workers_die_with_this_launcher()
    every_round_names_the_workers_store()
    rendezvous_events_name_their_caller_cheaply()
    announce_the_node_range(args)
    argv = advertise_this_node(args, argv)
    uninstall_the_agent = install_the_agent()
    # Made here, where the ``finally`` below removes it: a launch refused above leaves nothing in the temp folder
    job_dir = tempfile.mkdtemp(prefix="ddp-lab-job-")  # this node's workers' heartbeats (ddp_core.process.heartbeat)
    os.environ[heartbeat.JOB_DIR_ENV] = job_dir
    try:
        launch = torch_run.parse_args(argv)
        launch.training_script_args = [*launch.training_script_args, *script_args]
        errors_in_the_job_folder(launch, job_dir)
        launch.rdzv_conf = serve_the_c10d_store_here(launch)
        record(torch_run.run)(launch)  # what torch_run.main does, given the script's arguments apart
    except RENDEZVOUS_FAILURES as error:
        message = explain(error, args, roll_call)
        if message is None:
            raise
        if roll_call is not None:
            roll_call.stop()  # first: a store call of its failing as the store goes would print after the line
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(RENDEZVOUS_FAILED_EXIT_CODE) from None
    except SignalException as error:
        quiet.release()  # torchrun closed its workers because it was asked to stop: the lines say so, before ours
        print(
            f"stopped: torchrun got {error.sigval.name}; its workers stop after the step in progress and write a "
            f"checkpoint (within TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s); relaunch with --resume to continue",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(STOPPED_EXIT_CODE) from None
    except ChildFailedError as error:
        for code in STATED_EXIT_CODES:
            if _shared_exit_code(error, code):  # the workers printed why (global rank 0, one line)
                raise SystemExit(code) from None
        if not _shared_exit_code(error, STOPPED_EXIT_CODE):
            raise SystemExit(report_failure(error, args, job_dir, quiet)) from None
        print(
            "stopped: the workers got a stop signal and wrote a checkpoint; relaunch with --resume to continue",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(STOPPED_EXIT_CODE) from None
    finally:
        uninstall_the_agent()
        quiet.release()
        torch_log.removeFilter(quiet)
        error_log.removeFilter(quiet)
        SPARES.stop()
        shutil.rmtree(job_dir, ignore_errors=True)
        for name in (heartbeat.JOB_DIR_ENV, NNODES_RANGE_VARIABLE, RDZV_ROUND_VARIABLE):
            os.environ.pop(name, None)
        if roll_call is not None:
            roll_call.stop()


if __name__ == "__main__":
    main()
