"""ddp_core.torchrun's translations, without launching anything (the e2e tests launch it for real)."""

from __future__ import annotations

import os
import signal
import socket
from types import SimpleNamespace

import pytest
import torch.distributed.run as torch_run
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from ddp_core import torchrun
from ddp_core.distributed.network import NetworkChoice, list_interfaces
from ddp_core.exit_codes import STOPPED_EXIT_CODE
from ddp_core.process import agent, heartbeat
from ddp_core.process.launch import free_port
from ddp_core.torchrun import (
    RollCall,
    _shared_exit_code,
    advertise_this_node,
    explain,
)


def failed(*exitcodes: int) -> ChildFailedError:
    failures = {
        rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
        for rank, code in enumerate(exitcodes)
    }
    return ChildFailedError(name="experiments.toy", failures=failures)


def test_stopped_workers_map_to_the_stopped_code_and_failures_do_not():
    assert _shared_exit_code(failed(STOPPED_EXIT_CODE, STOPPED_EXIT_CODE), STOPPED_EXIT_CODE)
    assert _shared_exit_code(
        failed(-signal.SIGTERM, STOPPED_EXIT_CODE), STOPPED_EXIT_CODE
    )  # ended by torchrun in teardown
    assert not _shared_exit_code(failed(-signal.SIGTERM, -signal.SIGTERM), STOPPED_EXIT_CODE)  # nobody chose to stop
    assert not _shared_exit_code(failed(STOPPED_EXIT_CODE, 1), STOPPED_EXIT_CODE)  # a real failure is never hidden
    assert not _shared_exit_code(failed(-signal.SIGKILL, STOPPED_EXIT_CODE), STOPPED_EXIT_CODE)


def test_other_errors_are_left_to_torchrun():
    args = torch_run.parse_args(
        ["--nnodes=2", "--node-rank=0", "--master-addr=h", "--master-port=5", "--nproc-per-node=1", "x.py"]
    )
    assert explain(DistStoreError("some other store problem"), args) is None
    assert explain(ValueError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."), args) is None
    message = explain(DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."), args)
    assert message is not None and message.startswith(
        "only 1 of 2 nodes joined at h:5 within torchrun's rendezvous timeout"
    )


STATIC_THREE = [
    "--nnodes=3",
    "--node-rank=1",
    "--master-addr=10.0.0.1",
    "--master-port=29500",
    "--rdzv-conf=timeout=20",
    "--nproc-per-node=1",
    "x.py",
]
C10D_THREE = [
    "--nnodes=3",
    "--rdzv-backend=c10d",
    "--rdzv-endpoint=10.0.0.1:29400",
    "--rdzv-id=job",
    "--rdzv-conf=join_timeout=20",
    "--nproc-per-node=1",
    "x.py",
]


def roll_call(argv: list[str], *signed: tuple[int | None, str]) -> RollCall:
    """A roll call that saw these (node rank, host) sign, without starting its thread."""
    call = RollCall(torch_run.parse_args(argv))
    call.seen = [{"node_rank": rank, "host": host, "pid": 1} for rank, host in signed]
    return call


MISSING = [
    # (argv, signed, the one line)
    (
        STATIC_THREE,
        [(1, "b"), (0, "a")],
        "node 2 (--node-rank=2) never joined the rendezvous at 10.0.0.1:29500 within 20 seconds"
        " (joined: node 0 (a), node 1 (b)): "
        "start it, and check that it reaches 10.0.0.1:29500 (firewall, address)",
    ),
    (
        STATIC_THREE,
        [(1, "b")],
        "nodes 0, 2 never joined the rendezvous at 10.0.0.1:29500 within 20 seconds (joined: node 1 (b)):"
        " start them, and check that they reach",
    ),
    (
        C10D_THREE,
        [(None, "a"), (None, "a")],
        "1 of 3 nodes never joined the rendezvous at 10.0.0.1:29400 within 20 seconds (joined: a, a):"
        " start the missing node(s) with the same command",
    ),
]


@pytest.mark.parametrize("argv,signed,line", MISSING, ids=["static, one missing", "static, two missing", "c10d"])
@pytest.mark.parametrize(
    "error",
    [
        RendezvousTimeoutError(),
        DistStoreError("wait timeout after 20000ms, keys: /none/torchelastic/assigned_ranks/1"),
        DistNetworkError("Connection reset by peer"),
        RendezvousConnectionError("The connection to the C10d store has failed"),
        RendezvousClosedError(),
    ],
    ids=[
        "rendezvous timeout",
        "a key that never came",
        "the store went away",
        "c10d connection",
        "closed by another node",
    ],
)
def test_a_node_that_never_joined_is_named_on_every_node_that_did(argv, signed, line, error):
    message = explain(error, torch_run.parse_args(argv), roll_call(argv, *signed))
    assert message is not None and message.startswith(line), message


def test_everyone_came_or_the_store_was_never_reached_leaves_the_old_messages():
    args = torch_run.parse_args(STATIC_THREE)
    everyone = roll_call(STATIC_THREE, (0, "a"), (1, "b"), (2, "c"))
    assert everyone.missing() is None
    assert explain(DistStoreError("some other store problem"), args, everyone) is None
    nobody = roll_call(STATIC_THREE)
    assert explain(DistNetworkError("client socket timed out"), args, nobody).startswith(
        "node 0 unreachable at 10.0.0.1:29500"
    )


def test_the_roll_call_thread_ends_when_stopped_even_if_the_store_never_answers():
    port = free_port()  # nobody serves a store there
    call = RollCall(
        torch_run.parse_args(
            [
                "--nnodes=2",
                "--node-rank=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--nproc-per-node=1",
                "x.py",
            ]
        )
    ).start()
    assert call.thread.is_alive()
    # it only ever waits in plain sockets and short store calls: a thread left in C++ aborts the process at exit
    call.stop()
    assert not call.thread.is_alive() and call.missing() is None


def test_torchs_own_guess_of_the_store_host_is_what_the_launcher_reads():
    # torch decides through its own function when --rdzv-conf has no is_host; reading it is how an upgrade is caught
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    hosts = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn(), "192.0.2.123"]
    hosts += [address.split("%")[0] for interface in list_interfaces() for address in interface.addresses]
    assert {host: torchrun._named_as_this_host(host) for host in hosts} == {
        host: _matches_machine_hostname(host) for host in hosts
    }


C10D_HERE = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=job", "--nproc-per-node=1"]


@pytest.mark.parametrize(
    ("flags", "conf"),
    [
        ([], "is_host=1"),
        (["--rdzv-conf=join_timeout=20"], "join_timeout=20,is_host=1"),
        (["--rdzv_conf", "join_timeout=20"], "join_timeout=20,is_host=1"),
        (["--rdzv-conf", "is_host=0"], "is_host=0"),  # yours wins
        (["--rdzv-conf=join_timeout=20, is_host=false"], "join_timeout=20, is_host=false"),
        (["--standalone"], ""),
    ],
)
def test_the_agent_on_the_endpoints_interface_is_told_to_serve_the_c10d_store(monkeypatch, flags, conf):
    monkeypatch.setattr(torchrun, "_named_as_this_host", lambda host: False)  # as where the name means 127.0.1.1
    monkeypatch.setattr(torchrun, "is_local_address", lambda host: host == "127.0.0.1")
    port = free_port()
    launch = torch_run.parse_args([*C10D_HERE, f"--rdzv-endpoint=127.0.0.1:{port}", *flags, "x.py"])
    assert torchrun.serve_the_c10d_store_here(launch) == conf


def test_torch_decides_where_it_knows_the_host_the_endpoint_is_elsewhere_or_another_agent_serves_it(monkeypatch):
    monkeypatch.setattr(torchrun, "is_local_address", lambda host: host == "127.0.0.1")
    with socket.socket() as served:
        served.bind(("127.0.0.1", 0))
        served.listen()
        port = served.getsockname()[1]
        for endpoint, named_here in ((f"127.0.0.1:{port}", False), (f"10.9.9.9:{port}", False), ("127.0.0.1:1", True)):
            monkeypatch.setattr(torchrun, "_named_as_this_host", lambda host, named_here=named_here: named_here)
            launch = torch_run.parse_args([*C10D_HERE, f"--rdzv-endpoint={endpoint}", "--rdzv-conf=timeout=9", "x.py"])
            assert torchrun.serve_the_c10d_store_here(launch) == "timeout=9", endpoint
    static = torch_run.parse_args(STATIC_THREE)
    assert torchrun.serve_the_c10d_store_here(static) == "timeout=20"


@pytest.mark.parametrize(
    "argv,added",
    [
        (C10D_THREE, True),
        (["--local-addr=10.0.0.7", *C10D_THREE], False),  # yours wins
        (STATIC_THREE, False),  # static: MASTER_ADDR is given, workers use it as it is
        (
            ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "--nproc-per-node=1", "x.py"],
            False,
        ),  # all on this host
    ],
)
def test_c10d_advertises_the_address_that_reaches_the_endpoint(monkeypatch, capsys, argv, added):
    monkeypatch.setattr(
        torchrun,
        "reachable_address",
        lambda host, port: NetworkChoice(
            "GLOO_SOCKET_IFNAME",
            "eth0",
            "eth0",
            "10.0.0.2",
            f"the route to the rendezvous endpoint {host}; set ...",
            False,
        ),
    )
    result = advertise_this_node(torch_run.parse_args(argv), list(argv))
    assert (result == ["--local-addr=10.0.0.2", *argv]) is added and (result == argv) is not added
    if added:
        assert torch_run.parse_args(result).local_addr == "10.0.0.2"
        assert capsys.readouterr().out == (
            "rendezvous: this node is 10.0.0.2 to the others (eth0: the route to the rendezvous endpoint "
            "10.0.0.1); pass --local-addr to choose another\n"
        )


CLOSING = "Sending process 1234 closing signal SIGTERM"
QUIET_CASES = [  # (what torch logs, in order; then whether main() released the rest), what reaches the user
    ([CLOSING, "failed (exitcode: 2) local_rank: 1"], []),  # a stated exit: its worker's line stays last
    ([CLOSING, "failed (exitcode: 143) local_rank: 0"], []),
    (
        [CLOSING, "failed (exitcode: 1) local_rank: 1"],
        [CLOSING, "failed (exitcode: 1) local_rank: 1"],
    ),  # a crash: all of it, in order
    (
        [CLOSING, CLOSING.replace("1234", "1235")],
        [CLOSING, CLOSING.replace("1234", "1235")],
    ),  # torchrun asked to stop: released at the end
    (["Starting elastic_operator", CLOSING], ["Starting elastic_operator", CLOSING]),
]


@pytest.mark.parametrize(("logged", "shown"), QUIET_CASES)
def test_closing_lines_wait_for_the_reason_and_vanish_only_for_a_stated_exit(logged, shown):
    import logging

    logger = logging.getLogger(f"test_quiet_{id(logged)}")
    logger.propagate = False
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    quiet = torchrun._QuietStatedExits(logger)
    logger.addFilter(quiet)
    for message in logged:
        logger.warning(message)
    quiet.release()  # what main() does last
    assert seen == shown


@pytest.mark.parametrize(
    ("value", "grace"), [("3", 3), (None, 3), ("60", 3), ("1", 1), ("0", 0), ("soon", None), ("-1", None)]
)
def test_the_workers_of_a_failed_job_get_a_short_grace_not_a_fixed_30_s(monkeypatch, value, grace):
    """torch closes a failed job's other workers with a fixed 30 s grace: here 3 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    when shorter; a value torch would refuse leaves torch's own way (None)."""
    if value is None:
        monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", value)
    assert agent.failed_job_grace_s() == grace


class Handler:
    """A worker as torch's subprocess handler holds it: ``proc`` (poll, pid) and ``close(death_sig)``."""

    def __init__(self, pid: int, code: int | None, leaves_on: signal.Signals | None) -> None:
        self.code, self.leaves_on, self.signals = code, leaves_on, []
        self.proc = SimpleNamespace(pid=pid, poll=lambda: self.code)

    def close(self, death_sig: signal.Signals) -> None:
        self.signals.append(death_sig)
        if death_sig in (self.leaves_on, signal.SIGKILL):
            self.code = -death_sig


@pytest.mark.parametrize(
    ("codes", "closed"),
    [
        ((1, None, None), {2: [signal.SIGTERM], 3: [signal.SIGTERM, signal.SIGKILL]}),  # 3 ignores SIGTERM
        ((None, None, None), {}),  # nobody failed
        ((0, None, None), {}),  # a worker that finished is no failure
        ((2, 2, 2), {}),  # every worker left by itself
    ],
)
def test_after_a_failure_the_others_are_closed_and_noted_as_followers(monkeypatch, codes, closed):
    monkeypatch.setattr(agent, "closed_by_this_launcher", set())
    handlers = {rank: Handler(rank + 1, code, signal.SIGTERM if rank < 2 else None) for rank, code in enumerate(codes)}
    agent.close_after_a_failure(handlers, grace_s=0)
    assert {h.proc.pid: h.signals for h in handlers.values() if h.signals} == closed
    assert agent.closed_by_this_launcher == set(closed)
    assert all(h.proc.poll() is not None for h in handlers.values()) or not closed


def _failed(*codes: int) -> dict[int, ProcessFailure]:
    return {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in enumerate(codes)}


@pytest.mark.parametrize(
    ("codes", "refused"),
    [
        ((2, 2, 2), True),  # every worker refused: a restart would refuse again
        ((2, -signal.SIGTERM, -signal.SIGTERM), True),  # one refused, torchrun closed the others
        ((2, 1, 2), False),  # a crash beside the refusal: restarting may help
        ((-signal.SIGKILL, -signal.SIGTERM), False),  # a killed rank: what restarts are for
        ((-signal.SIGTERM, -signal.SIGTERM), False),  # no refusal at all
        ((1,), False),
    ],
)
def test_only_a_refusal_by_every_worker_ends_the_job_without_restarts(codes, refused):
    assert agent.refused_by_every_worker(_failed(*codes)) is refused


@pytest.mark.parametrize(
    ("flags", "announced"),
    [
        (["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1"], "1:2"),
        (["--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1"], "2:4"),
        (["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1"], None),  # no range: the size is fixed
        (["--nnodes=2:2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1"], None),
        (["--nnodes=1:2", "--rdzv-backend=static", "--master-addr=h"], None),  # static rendezvous cannot change
        (["--standalone", "--nnodes=1:2"], None),
    ],
)
def test_the_node_range_is_announced_to_the_workers_only_where_the_world_may_change(monkeypatch, flags, announced):
    monkeypatch.setenv(torchrun.NNODES_RANGE_VARIABLE, "stale")
    args = torch_run.get_args_parser().parse_args([*flags, "-m", "experiments.toy"])
    torchrun.announce_the_node_range(args)
    assert os.environ.get(torchrun.NNODES_RANGE_VARIABLE) == announced


SPLITS = [  # argv -> (torchrun's part, ending with the script; the script's arguments)
    (["--standalone", "--nproc-per-node=2", "-m", "experiments.toy", "--nproc", "2"], 4),
    (["--nproc-per-node", "2", "-m", "experiments.toy", "--nproc=2", "--lr", "1"], 4),
    (["--nproc_per_node", "3", "--rdzv-conf", "join_timeout=5", "train.py", "--nnodes", "x"], 5),
    (["-r", "3", "-t3", "--no-python", "echo", "-m", "a"], 5),
    (["--nnodes=1:2", "--max-restarts", "3", "--", "script.py", "--standalone"], 5),
    (["--standalone", "--run-path", "script.py"], 3),
    (["--standalone"], 1),
]


@pytest.mark.parametrize(("argv", "head"), SPLITS)
def test_the_script_arguments_are_not_read_as_torchruns_options(argv, head):
    options, script_args = torchrun.split_at_the_script(argv)
    assert (options, script_args) == (argv[:head], argv[head:])
    if script_args:  # torchrun's own parser agrees on the script where it does not stumble on the arguments
        assert torch_run.parse_args(options).training_script == options[-1]


@pytest.mark.parametrize(
    "argv", [["--nnodes=x", "-m", "experiments.toy"], ["--no-such-option", "-m", "experiments.toy"]]
)
def test_a_launch_refused_by_its_options_leaves_nothing_in_the_temp_folder(monkeypatch, tmp_path, argv):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises((SystemExit, ValueError)):
        torchrun.main(argv)
    assert list(tmp_path.iterdir()) == []
    assert heartbeat.JOB_DIR_ENV not in os.environ


@pytest.mark.parametrize(
    ("flags", "in_the_job_folder"),
    [
        ([], True),
        (["--log-dir", "/logs"], False),  # the user's folder
        (["--redirects", "3"], False),  # the workers' output: kept where torch puts it, for the user to read
        (["--tee", "1"], False),
    ],
)
def test_torchs_error_files_go_into_the_launchs_own_folder_unless_they_are_the_users(flags, in_the_job_folder):
    launch = torch_run.parse_args([*flags, "-m", "experiments.toy"])
    before = launch.log_dir
    torchrun.errors_in_the_job_folder(launch, "/tmp/ddp-lab-job-x")
    assert launch.log_dir == ("/tmp/ddp-lab-job-x/errors" if in_the_job_folder else before)
