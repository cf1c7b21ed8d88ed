"""``python -m ddp_core.torchrun [torchrun's arguments]``: torchrun, with one plain sentence or report instead of a
traceback when the nodes never meet, a stop was asked for or a rank failed.

torchrun's parser reads the arguments; the agent (ddp_core.process.agent) runs in this process. What it adds:
docs/decisions.md, "The launcher" and "Several hosts".
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from ddp_core.exit_codes import KILLED_EXIT_CODE_BASE
from ddp_core.process import timeline

STOPPED_BEFORE_THE_WORKERS = "stopped: torchrun got SIGINT before its workers started: relaunch to start over"


def _stopped_while_importing(*_: object) -> NoReturn:
    """Ctrl-C while torch is imported (seconds) or the launch is set up: one line, exit 130, by ``os._exit``: an
    import cut short by an exception leaves modules half made, which the interpreter's exit imports again."""
    print(STOPPED_BEFORE_THE_WORKERS, file=sys.stderr, flush=True)
    os._exit(KILLED_EXIT_CODE_BASE + signal.SIGINT)


if __name__ == "__main__":  # before torch is imported: a Ctrl-C is this line, never an import's traceback
    signal.signal(signal.SIGINT, _stopped_while_importing)
    timeline.mark("launcher")  # tests/e2e/test_ctrl_c.py: the handler is in place

import ipaddress
import logging
import re
import shutil
import socket
import tempfile
import uuid
from argparse import Namespace
from collections.abc import Sequence

import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddp_core.distributed.env import NNODES_RANGE_VARIABLE, RDZV_ROUND_VARIABLE
from ddp_core.distributed.network import is_local_address, is_loopback, reachable_address
from ddp_core.errors import ConfigError
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE, FAILED_EXIT_CODE, FINISHED_EXIT_CODES, STOPPED_EXIT_CODE
from ddp_core.process import failure_report, heal, heartbeat
from ddp_core.process.agent import closed_by_this_launcher, launch_agent
from ddp_core.process.roll_call import RENDEZVOUS_FAILURES, RollCall, endpoint, explain

RENDEZVOUS_FAILED_EXIT_CODE = FAILED_EXIT_CODE
DEFAULT_MASTER_PORT = 29500  # torchrun's, for static rendezvous without --master-port
# Workers that stop themselves for a reason they print in one line (ddp_core.errors.RunStoppedError) all
# exit with its code; the job exits with it too, instead of torchrun's 1 and its failure summary.
STATED_EXIT_CODES = tuple(sorted(FINISHED_EXIT_CODES - {0, STOPPED_EXIT_CODE}))

C10D_DEFAULT_PORT = 29400  # torch's, for a c10d endpoint without a port
PROBE_TIMEOUT_S = 1.0


def _named_as_this_host(host: str) -> bool:
    """What torch's c10d backend guesses when --rdzv-conf has no ``is_host``: ``localhost``, a loopback address,
    this host's name or canonical name, or an address this host's name resolves to."""
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
    """``launch``'s --rdzv-conf, with ``is_host=1`` where the endpoint is an address of this host's interfaces that
    torch does not recognise (a host name resolving to 127.0.1.1), the user did not say, and nothing answers there.

    Left: two agents of one host started at the same instant may both serve it; the second fails to bind.
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


def announce_the_node_range(args: Namespace) -> None:
    """``DDP_LAB_NNODES_RANGE=MIN:MAX`` for the workers under c10d with --nnodes=MIN:MAX (MIN < MAX), else unset:
    torchrun tells its workers the world size of each round, not that the user allowed it to change."""
    low, high = torch_run.parse_min_max_nnodes(args.nnodes)
    if args.rdzv_backend != "static" and not args.standalone and low < high:
        os.environ[NNODES_RANGE_VARIABLE] = f"{low}:{high}"
    else:
        os.environ.pop(NNODES_RANGE_VARIABLE, None)


def advertise_this_node(args: Namespace, argv: list[str]) -> list[str]:
    """c10d: --local-addr defaults to the address of the interface that reaches the endpoint, not the host name
    (which may resolve to loopback); a --local-addr of yours wins."""
    if args.rdzv_backend != "c10d" or args.local_addr or args.standalone:
        return argv
    host, _, port = endpoint(args).rpartition(":")
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
    """Every worker exited with ``code``, or was ended by torchrun's SIGTERM after one did (in teardown)."""
    codes = {failure.exitcode for failure in error.failures.values()}
    return code in codes and codes <= {code, -signal.SIGTERM}


TORCH_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.multiprocessing.errors.error_handler",
)


class _QuietStatedExits(logging.Filter):
    """Keeps the user's last line the one that says why: torch's lines about workers' exits are held until the
    job's end, then dropped for a stated code, kept in the report's file (``forget``; ``seen``) or printed."""

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

    @classmethod
    def install(cls) -> _QuietStatedExits:
        """On torch's loggers of its workers' exits and of its error handler."""
        quiet = cls(logging.getLogger(TORCH_LOGGERS[0]))
        for name in TORCH_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
        return quiet

    def uninstall(self) -> None:
        self.release()
        for name in TORCH_LOGGERS:
            logging.getLogger(name).removeFilter(self)

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
    tracebacks = [
        f"--- rank {rank} (exit code {failure.exitcode}), its error file {failure.error_file}:\n"
        + _callstack(failure.error_file_data)
        for rank, failure in sorted(error.failures.items())
        if _has_error_file(failure)
    ]
    quiet.forget()  # torch's held lines go to the report's file (``seen``), not the console
    node_rank = int(getattr(args, "node_rank", 0) or 0)
    return failure_report.report_and_print(_culprits(error), job_dir, node_rank, [*quiet.seen, str(error), *tracebacks])


def split_at_the_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's options and the script, then the script's own arguments: argparse would read a script's
    ``--nproc 2`` as an ambiguous abbreviation of torchrun's ``--nproc-per-node``."""
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
    """Without --log-dir, --redirects and --tee, the workers' error files go into this launch's own folder,
    removed with it, not a ``torchelastic_*`` folder torch leaves behind."""
    if launch.log_dir is None and launch.redirects == "0" and launch.tee == "0":
        launch.log_dir = os.path.join(job_dir, "errors")


def run(launch: Namespace) -> None:
    """What ``torch.distributed.run.run`` does with parsed arguments, with this launcher's agent."""
    single_node_static = launch.rdzv_backend == "static" and not launch.rdzv_endpoint and launch.master_port is None
    if launch.standalone or (single_node_static and torch_run.parse_min_max_nnodes(launch.nnodes)[1] == 1):
        launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if launch.master_port is None:
        launch.master_port = DEFAULT_MASTER_PORT
    config, command, command_args = torch_run.config_from_args(launch)
    launch_agent(config, command, command_args)


def exit_code(
    error: BaseException, args: Namespace, job_dir: str, quiet: _QuietStatedExits, roll_call: RollCall | None
) -> int | None:
    """The job's exit code for what ended it, after its one line or report; None for an error not explained here."""
    if isinstance(error, SignalException):
        return stopped_by_signal(error.sigval, job_dir, quiet)
    if isinstance(error, ChildFailedError):
        for code in STATED_EXIT_CODES:
            if _shared_exit_code(error, code):  # the workers printed why (global rank 0, one line)
                quiet.forget()  # torch's lines about it (which may name a worker closed after it) say nothing more
                return code
        if not _shared_exit_code(error, STOPPED_EXIT_CODE):
            return report_failure(error, args, job_dir, quiet)
        quiet.forget()
        print(
            "stopped: the workers got a stop signal and wrote a checkpoint; relaunch with --resume to continue",
            file=sys.stderr,
            flush=True,
        )
        return STOPPED_EXIT_CODE
    message = explain(error, args, roll_call)
    if message is None:
        return None
    if roll_call is not None:
        roll_call.stop()  # first: a store call of its failing as the store goes would print after the line
    print(f"error: {message}", file=sys.stderr, flush=True)
    return RENDEZVOUS_FAILED_EXIT_CODE


def stopped_by_signal(sigval: signal.Signals, job_dir: str, quiet: _QuietStatedExits) -> int:
    """torchrun was asked to stop (Ctrl-C, SIGTERM) and has closed its workers (it waits for them): a worker whose
    run had started stopped after its step in progress and wrote a checkpoint; one still starting just ended. The
    line names a checkpoint only where the run directory (from the workers' heartbeats) holds one: then exit 143;
    else nothing can be resumed, and the job exits 128 + the signal (130 after Ctrl-C), as a shell reports it."""
    from ddp_core.output.checkpoint import CheckpointDir  # only here: torch.load and the like

    run_dir = heartbeat.run_dir(job_dir)
    newest = CheckpointDir.of_run(run_dir).newest() if run_dir is not None and run_dir.is_dir() else None
    if newest is None:
        quiet.forget()  # torch's lines on closing workers that had not started: this line says all there is
        print(
            f"stopped: torchrun got {sigval.name} before the run wrote a checkpoint: nothing to resume; "
            "relaunch to start over",
            file=sys.stderr,
            flush=True,
        )
        return KILLED_EXIT_CODE_BASE + sigval
    quiet.release()  # torchrun closed its workers because it was asked to stop: the lines say so, before ours
    print(
        f"stopped: torchrun got {sigval.name}; its workers stopped after the step in progress; the last checkpoint "
        f"is {newest}: relaunch with --resume --run-dir {run_dir} to continue",
        file=sys.stderr,
        flush=True,
    )
    return STOPPED_EXIT_CODE


def main(argv: Sequence[str] | None = None) -> None:
    argv, script_args = split_at_the_script(list(sys.argv[1:] if argv is None else argv))
    healing, argv = "--heal" in argv, [word for word in argv if word != "--heal"]  # torchrun's options only
    args = torch_run.parse_args(argv)
    if healing and (why := heal.refusal(args, torch_run.parse_min_max_nnodes(args.nnodes))):
        print(f"error: {why}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT_CODE)
    quiet = _QuietStatedExits.install()
    roll_call = None if args.standalone else RollCall(args).start()
    announce_the_node_range(args)
    argv = advertise_this_node(args, argv)
    # Made here, where the ``finally`` below removes it: a launch refused above leaves nothing in the temp folder
    job_dir = tempfile.mkdtemp(prefix="ddp-lab-job-")  # this node's workers' heartbeats (ddp_core.process.heartbeat)
    os.environ[heartbeat.JOB_DIR_ENV] = job_dir
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on a KeyboardInterrupt, caught below
        launch = torch_run.parse_args(argv)
        launch.training_script_args = [*launch.training_script_args, *script_args]
        for name in heal.VARIABLES:  # a torchrun started by a worker heals only when told to
            os.environ.pop(name, None)
        if healing:  # the clients replace a dead worker; torch's restarts would restart the whole group
            os.environ.update({heal.VARIABLE: "1", heal.BUDGET_VARIABLE: str(launch.max_restarts)})
            os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
            launch.max_restarts = 0
        errors_in_the_job_folder(launch, job_dir)
        launch.rdzv_conf = serve_the_c10d_store_here(launch)
        record(run)(launch)  # as torch_run.main, given the script's arguments apart
    except (*RENDEZVOUS_FAILURES, SignalException, ChildFailedError) as error:
        code = exit_code(error, args, job_dir, quiet, roll_call)
        if code is None:
            raise
        raise SystemExit(code) from None
    except KeyboardInterrupt:  # Ctrl-C before torch's handler, which turns it into a SignalException, started workers
        quiet.forget()
        print(STOPPED_BEFORE_THE_WORKERS, file=sys.stderr)
        raise SystemExit(KILLED_EXIT_CODE_BASE + signal.SIGINT) from None
    finally:
        quiet.uninstall()
        shutil.rmtree(job_dir, ignore_errors=True)
        for name in (heartbeat.JOB_DIR_ENV, NNODES_RANGE_VARIABLE, RDZV_ROUND_VARIABLE, *heal.VARIABLES):
            os.environ.pop(name, None)
        if roll_call is not None:
            roll_call.stop()


if __name__ == "__main__":
    main()
