"""Who prints a line every rank would print (ddp_core/output/logging.py states the rule), in one process posing as
each rank by its launch variables. The real launches at 2, 3 and 4 processes: tests/e2e/test_printed_once.py."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

import experiments.toy as toy
from ddp_core import errors
from ddp_core.config import parse_args
from ddp_core.errors import ConfigError, NodeConfigError, alike_on_the_node, exits_with_one_line
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.experiment import experiment_main
from ddp_core.output.logging import setup_logging, this_ranks_own, torch_handlers
from ddp_core.ranks import THIS_RANK
from experiments.toy import ToyArgs

RANK_1_OF_3 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
RANK_3_OF_4_NODE_1 = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
RANK_2_OF_4_NODE_1 = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch):
    def pose(variables: dict[str, str]) -> None:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOG_ALL_RANKS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return pose


@pytest.fixture
def closed_by_the_launcher():
    """torchrun's SIGTERM, already sent: pending (blocked) until the rank waits for it, so no timing is involved."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # to this thread: a signal to the process could go to another of pytest's threads, which do not block it
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    yield
    pending = signal.sigpending()
    if signal.SIGTERM in pending:  # not taken: take it here rather than let it end pytest
        signal.sigtimedwait({signal.SIGTERM}, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def printed(capsys, fn, *args) -> str:
    """stderr of ``exits_with_one_line(fn)(*args)``, which must exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        exits_with_one_line(fn)(*args)
    assert stop.value.code == CONFIG_ERROR_EXIT_CODE
    return capsys.readouterr().err


def bad_lr() -> None:
    parse_args(ToyArgs, ["--lr", "-1"])


def raises(error: ConfigError):
    def fn() -> None:
        raise error

    return fn


BAD_FLAG = (["--lr", "-1"], "error: --lr=-1 is out of range")  # parse_args
FAILED_CHECK = (["--batch-size", "300", "--dataset-size", "256"], "error: --batch-size=300 is larger")  # toy's validate


FAILED_PREPARE = ([], "error: the node's data is corrupt: re-download it")  # an experiment's prepare (CIFAR10's data)


def corrupt_data(args: ToyArgs) -> None:
    raise ConfigError("the node's data is corrupt: re-download it")


TOY_WITH_DATA = experiment_main("toy", ToyArgs, toy.train, doc="the toy, with data to prepare", prepare=corrupt_data)


def run_toy(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        (TOY_WITH_DATA if argv is FAILED_PREPARE[0] else toy.main)(argv)
    assert stop.value.code == CONFIG_ERROR_EXIT_CODE
    return capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # torch's @record, with stderr captured
@pytest.mark.parametrize(
    ("argv", "line"), [BAD_FLAG, FAILED_CHECK, FAILED_PREPARE], ids=["bad-flag", "failed-check", "failed-prepare"]
)
def test_flags_checks_and_data_are_read_alike_on_the_node(capsys, as_rank, closed_by_the_launcher, argv, line):
    as_rank({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"})
    assert run_toy(capsys, argv).startswith(line)  # local rank 0 prints it
    as_rank(RANK_1_OF_3)
    assert run_toy(capsys, argv) == ""  # rank 1 leaves it to local rank 0, and is closed by the launcher


@pytest.mark.parametrize(("variables", "shown"), [({}, True), (RANK_2_OF_4_NODE_1, True), (RANK_1_OF_3, False)])
def test_help_is_printed_once_per_node(capsys, as_rank, variables, shown):
    as_rank(variables)
    with pytest.raises(SystemExit) as stop:
        parse_args(ToyArgs, ["--help"])
    assert stop.value.code == 0 and ("--lr" in capsys.readouterr().out) is shown  # every process exits 0


@pytest.mark.parametrize(
    "variables",
    [{}, RANK_2_OF_4_NODE_1],
    ids=["alone", "node-1-local-rank-0"],
)
def test_local_rank_0_prints_a_node_wide_line_on_every_node(capsys, as_rank, variables):
    as_rank(variables)
    assert printed(capsys, bad_lr).startswith("error: --lr=-1 is out of range")


@pytest.mark.parametrize("variables", [RANK_1_OF_3, RANK_3_OF_4_NODE_1], ids=["rank-1-of-3", "node-1-local-rank-1"])
def test_the_other_processes_wait_for_the_launcher_to_close_them_and_print_nothing(
    capsys, as_rank, closed_by_the_launcher, variables
):
    as_rank(variables)
    assert printed(capsys, bad_lr) == ""
    assert signal.SIGTERM not in signal.sigpending()  # the wait took the launcher's signal


def test_a_process_the_launcher_does_not_close_says_it_itself(capsys, as_rank, monkeypatch):
    """Its local rank 0 did not fail so (it read another file, or raced a change): the line is not lost."""
    as_rank(RANK_1_OF_3)
    monkeypatch.setattr(errors, "PEERS_CLOSE_WITHIN_S", 0.0)
    assert printed(capsys, bad_lr).startswith("error: --lr=-1 is out of range")


@pytest.mark.parametrize(
    ("error", "variables", "shown"),
    [
        (ConfigError("RANK=5 must be < WORLD_SIZE=3"), RANK_1_OF_3, True),  # this rank's own: never hidden
        (NodeConfigError("node 0 cannot start"), RANK_1_OF_3, False),  # its local rank 0 prints it
        (NodeConfigError("node 1 cannot start"), RANK_2_OF_4_NODE_1, True),
    ],
    ids=["own", "node-elsewhere", "node-here"],
)
def test_a_line_not_read_alike_stays_with_the_rank_that_raised_it(capsys, as_rank, error, variables, shown):
    as_rank(variables)
    assert bool(printed(capsys, raises(error))) is shown


def test_an_agreed_line_is_never_marked_node_wide():
    agreed = ConfigError("rank 0 decided")
    agreed.agreed = True
    with pytest.raises(ConfigError), alike_on_the_node():
        raise agreed
    assert not agreed.node_wide


TORCHS = ["torch's alike", "torch's, propagated", "torch's failure"]


@pytest.fixture
def console(capsys):
    """The root logger and torch's handlers as setup_logging leaves them, put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield capsys
    root.handlers[:] = handlers
    root.setLevel(level)
    for handler in torch_handlers():
        handler.removeFilter(this_ranks_own)


def logged_lines(console) -> list[str]:
    setup_logging()
    log = logging.getLogger("check")
    log.info("info")
    log.warning("alike")
    log.warning("own", extra=THIS_RANK)
    log.info("own info", extra=THIS_RANK)
    log.error("failed")
    logging.getLogger("torch._dynamo").warning("torch's alike")  # torch's own handlers, on stderr
    logging.getLogger("torch.utils.cpp_extension").warning("torch's, propagated")  # to the "torch" logger's handler
    logging.getLogger("torch._inductor").error("torch's failure")
    printed = console.readouterr()  # ours: "12:00:00 [rank 1/3] LEVEL message"; torch's: "W1127 ... file:123] message"
    return [line.split("] ", 1)[1] for line in printed.out.splitlines()] + [
        line.rsplit("] ", 1)[1] for line in printed.err.splitlines()
    ]


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"RANK": "0", "WORLD_SIZE": "3"},
            ["INFO info", "WARNING alike", "WARNING own", "INFO own info", "ERROR failed", *TORCHS],
        ),
        ({"RANK": "1", "WORLD_SIZE": "3"}, ["WARNING own", "INFO own info", "ERROR failed", "torch's failure"]),
        (
            {"RANK": "1", "WORLD_SIZE": "3", "LOG_ALL_RANKS": "1"},
            ["INFO info", "WARNING alike", "WARNING own", "INFO own info", "ERROR failed", *TORCHS],
        ),
    ],
    ids=["rank-0", "rank-1", "rank-1-LOG_ALL_RANKS"],
)
def test_off_rank_0_a_log_record_is_shown_only_if_it_is_this_ranks_own(console, as_rank, variables, expected):
    as_rank(variables)
    assert logged_lines(console) == expected
