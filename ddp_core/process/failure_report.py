"""The launcher's report of a rank that failed, printed once per node by both launch paths: a few lines naming it
(a hang: 124; a signal: 128+N; an exception: its traceback, 1) and torch's own output kept in ``failure_node<N>.txt``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ddp_core.exit_codes import FAILED_EXIT_CODE, HUNG_EXIT_CODE, KILLED_EXIT_CODE_BASE
from ddp_core.layout import FLIGHT_RECORDER, failure_report_name, stacks_name
from ddp_core.process.heartbeat import Heartbeat, read

TIMEOUT_ERROR = "CollectiveTimeoutError"
PEER_EXITED_ERROR = "PeerExitedError"


@dataclass(frozen=True)
class RankFailure:
    rank: int
    host: str
    exitcode: int  # negative: killed by that signal
    message: str = ""  # "ExceptionType: text", from the error file; empty for a signal
    traceback: str = ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _checkpoint(run_dir: Path | None) -> str:
    from ddp_core.output.checkpoint import CheckpointDir

    newest = CheckpointDir.of_run(run_dir).newest() if run_dir is not None and run_dir.is_dir() else None
    if newest is None:
        return "no checkpoint was written yet: relaunch to start over"
    return f"the last checkpoint is {newest}: relaunch with --resume to continue from it"


def _is_timeout(failure: RankFailure) -> bool:
    return failure.message.startswith(TIMEOUT_ERROR) or f".{TIMEOUT_ERROR}: " in failure.message


def report_path(run_dir: Path | None, node_rank: int) -> Path:
    if run_dir is not None and run_dir.is_dir():
        return run_dir / failure_report_name(node_rank)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d_%H%M%S")
    return Path("runs") / "failures" / f"{stamp}_node{node_rank}.txt"


def keep_full_output(path: Path, parts: Iterable[str]) -> Path | None:
    """Write torch's own output to ``path``; None when it cannot be written (the report then says so)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts) + "\n")
    except OSError:
        return None
    return path


def flight_recorder_files(run_dir: Path | None) -> list[Path]:
    """The dumps of this job: where TORCH_FR_DUMP_TEMP_FILE puts them, else in the run directory."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if prefix:
        return sorted(Path(prefix).parent.glob(f"{Path(prefix).name}*"))
    return sorted(run_dir.glob(f"{FLIGHT_RECORDER}*")) if run_dir is not None else []


def report(
    culprits: Sequence[RankFailure], beats: dict[int, Heartbeat], full_output: Path | None
) -> tuple[list[str], int]:
    """The lines to print (a traceback first, for an exception) and the job's exit code."""
    run_dir = next((beat.run_dir for beat in beats.values()), None)
    kept = f"torch's full output: {full_output}" if full_output is not None else "torch's output could not be kept"
    ordered = sorted(culprits, key=lambda failure: failure.rank)
    hung = [failure for failure in ordered if _is_timeout(failure)]
    if hung:  # the ranks that waited say who did not arrive; a rank closed after them is not the cause
        return _hung(f"error: {hung[0].message.split(f'{TIMEOUT_ERROR}: ', 1)[1]}", run_dir, list(beats), kept)
    killed = [failure for failure in ordered if failure.exitcode < 0]
    if killed:
        first = killed[0]
        dumped = {name[len(name.rstrip("0123456789")) :] for name in map(str, flight_recorder_files(run_dir))}
        if first.exitcode == -signal.SIGABRT and str(first.rank) in dumped:  # NCCL's watchdog dumps, then aborts
            why = "aborted after a flight-recorder dump: NCCL's watchdog ends a rank whose collective timed out"
            return _hung(f"error: rank {first.rank} {why} (DIST_TIMEOUT_S)", run_dir, list(beats), kept)
        name = _signal_name(-first.exitcode)
        beat = beats.get(first.rank)
        where = f"after step {beat.step}" if beat is not None else "before its training started"
        cause = (
            "often the out-of-memory killer (dmesg | grep -i oom; lower --batch-size) or a kill -9"
            if first.exitcode == -signal.SIGKILL
            else "a crash in native code (a bug, a driver)"
            if first.exitcode in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT, -signal.SIGILL)
            else "a signal sent from outside"
        )
        more = f" (and rank(s) {', '.join(str(f.rank) for f in killed[1:])})" if len(killed) > 1 else ""
        return [
            f"error: rank {first.rank}{more} (host {first.host}) was killed by {name} {where}: {cause}; "
            f"{_checkpoint(run_dir)}",
            kept,
        ], KILLED_EXIT_CODE_BASE + (-first.exitcode)
    raised = [failure for failure in ordered if failure.message and PEER_EXITED_ERROR not in failure.message]
    if raised:
        first = raised[0]
        beat = beats.get(first.rank)
        at = f" in step {beat.step + 1}" if beat is not None else ""
        lines = [first.traceback.rstrip()] if first.traceback else []
        kind = first.message.split(":", 1)[0].rsplit(".", 1)[-1]
        return [
            *lines,
            f"error: rank {first.rank} (host {first.host}) raised {kind}{at} (its traceback above; the other ranks "
            f"stopped with it); {_checkpoint(run_dir)}; {kept}",
        ], FAILED_EXIT_CODE
    ranks = ", ".join(str(failure.rank) for failure in ordered) or "?"
    peers = any(PEER_EXITED_ERROR in failure.message for failure in ordered)
    why = (
        "a rank of another node exited during a collective: that node's report says why"
        if peers
        else "with no traceback (its own output above says why)"
    )
    codes = {failure.exitcode for failure in ordered}
    code = ordered[0].exitcode if len(codes) == 1 and ordered[0].exitcode > 0 else FAILED_EXIT_CODE
    return [f"error: rank(s) {ranks} failed {why}; {_checkpoint(run_dir)}; {kept}"], code


def _hung(line: str, run_dir: Path | None, ranks: list[int], kept: str) -> tuple[list[str], int]:
    """A hang's report: its line, each rank's innermost frame of its own code, where the files are."""
    dumps = flight_recorder_files(run_dir)
    files = "no flight-recorder file was written"
    if dumps:
        named = dumps[0].name.rstrip("0123456789")  # the prefix before each rank's number
        prefix = "" if named == FLIGHT_RECORDER else f" --prefix {named}"
        read = f"python -m ddp_core.distributed.flight_recorder {dumps[0].parent}{prefix}"
        files = f"flight recorder: {', '.join(map(str, dumps))} ({read})"
    paths = [run_dir / stacks_name(rank) for rank in sorted(ranks)] if run_dir is not None else []
    where = [path.read_text().split("\n", 1)[0] for path in paths if path.is_file()]  # ddp_core.distributed.stacks
    if where and run_dir is not None:
        files += f"; each rank's stacks: {run_dir / stacks_name('N')}"
    return [line, *where, f"{files}; {kept}"], HUNG_EXIT_CODE


def report_and_print(culprits: Sequence[RankFailure], job_dir: str, node_rank: int, output: Iterable[str]) -> int:
    """Print the report of this node's ``culprits``, torch's ``output`` kept in a file; the job's exit code."""
    beats = read(job_dir)
    run_dir = next((beat.run_dir for beat in beats.values()), None)
    lines, code = report(culprits, beats, keep_full_output(report_path(run_dir, node_rank), output))
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code
