"""run_and_exit in a real subprocess: a finished main leaves with os._exit, every other outcome is kept.

Each case runs a small script in its own interpreter (os._exit would end pytest). The script's main
prints to a pipe without flushing, logs to a file, registers an atexit handler and leaves a non-daemon
thread running, so an exit that skipped the flushing, the atexit handlers or the thread join loses output. An object
with a ``__del__`` in the module's globals tells whether the interpreter's finalization ran: it must not
after a finished main (that is where torch's gloo threads abort the process), and may after a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_core.exit_codes import STOPPED_EXIT_CODE
from ddp_core.process.launch import launch

REPO = Path(__file__).resolve().parents[2]
LINES = 2000  # more than one pipe buffer (8 KB): an unflushed stdout would lose them
BUFFERED_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # or nothing is left to flush

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys, threading
    from ddp_core.process.exit import run_and_exit

    class Finalized:
        def __del__(self):
            print("finalized", file=sys.stderr, flush=True)

    witness = Finalized()  # collected only when the interpreter finalizes its modules

    def after_main_thread_ends(path):
        threading.main_thread().join()  # returns once the exit sequence has begun
        with open(path, "w") as handle:
            handle.write("thread done")

    def main():
        logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
        logging.info("logged before exit")
        atexit.register(print, "atexit handler ran", file=sys.stderr)  # as torch.compile's worker shutdown is
        threading.Thread(target=after_main_thread_ends, args=(sys.argv[3],)).start()
        for i in range({lines}):
            print(f"line {{i}}")  # no flush: a pipe is block-buffered
        {ending}

    run_and_exit(main)
    """
)


@dataclass
class Outcome:
    result: subprocess.CompletedProcess
    log: Path
    thread_file: Path


ENDINGS = {
    "return": "return 'result'",
    "exit 0": "raise SystemExit(0)",
    "exit 143": f"raise SystemExit({STOPPED_EXIT_CODE})",
    "exception": "raise RuntimeError('boom in main')",
    "exit 2": "raise SystemExit(2)",
    "message": "raise SystemExit('error: no such file')",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every case's finished subprocess; all started at once (each spends seconds importing torch)."""
    started = {}
    for name, ending in ENDINGS.items():
        folder = tmp_path_factory.mktemp(name.replace(" ", "_"))
        log, thread_file = folder / "log.txt", folder / "thread.txt"
        command = [
            sys.executable,
            "-c",
            SCRIPT.format(lines=LINES, ending=ending),
            "unused",
            str(log),
            str(thread_file),
        ]
        process = subprocess.Popen(
            command, cwd=REPO, env=BUFFERED_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started[name] = (process, command, log, thread_file)
    finished = {}
    for name, (process, command, log, thread_file) in started.items():
        try:
            stdout, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        finished[name] = Outcome(
            subprocess.CompletedProcess(command, process.returncode, stdout, stderr), log, thread_file
        )
    return finished


def assert_everything_written(outcome: Outcome) -> None:
    lines = outcome.result.stdout.splitlines()
    assert len(lines) == LINES and lines[-1] == f"line {LINES - 1}", outcome.result.stdout[-300:]
    assert "logged before exit" in outcome.log.read_text()
    assert "atexit handler ran" in outcome.result.stderr
    assert outcome.thread_file.read_text() == "thread done"


@pytest.mark.parametrize("case, code", [("return", 0), ("exit 0", 0), ("exit 143", STOPPED_EXIT_CODE), ("exit 2", 2)])
def test_a_finished_main_flushes_everything_then_skips_finalization(outcomes, case, code):
    outcome = outcomes[case]
    assert outcome.result.returncode == code, outcome.result.stderr
    assert_everything_written(outcome)
    assert "finalized" not in outcome.result.stderr  # os._exit: the phase where gloo's threads abort never ran


def test_an_exception_keeps_its_traceback_and_exit_code(outcomes):
    outcome = outcomes["exception"]
    assert outcome.result.returncode == 1
    assert (
        "Traceback (most recent call last)" in outcome.result.stderr
        and "RuntimeError: boom in main" in outcome.result.stderr
    )
    assert_everything_written(outcome)
    assert "finalized" in outcome.result.stderr  # the interpreter's own exit, untouched


def test_a_message_exit_still_prints_and_fails(outcomes):
    result = outcomes["message"].result
    assert result.returncode == 1 and "error: no such file" in result.stderr


# --nproc: the spawned workers leave through run_and_exit too. Module-level: spawned children import them.
class NprocArgs:
    def __init__(self, nproc: int, out: Path, fail: bool) -> None:
        self.nproc, self.out, self.fail = nproc, out, fail


class SpawnedFinalized:
    def __del__(self) -> None:
        os.write(2, b"spawned worker finalized\n")


def nproc_worker(args: NprocArgs) -> None:
    # A module only sys.modules holds: the interpreter's finalization drops it, and the witness with it.
    witness = types.ModuleType("spawned_exit_witness")
    witness.finalized = SpawnedFinalized()  # type: ignore[attr-defined]
    sys.modules[witness.__name__] = witness
    rank = int(os.environ["RANK"])
    if args.fail and rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    (args.out / f"rank{rank}.txt").write_text("done")


def test_spawned_workers_finish_without_finalization_and_a_failing_one_fails_the_launch(
    clean_env, tmp_path, capfd, monkeypatch
):
    work = tmp_path / "work"
    work.mkdir()
    assert launch(nproc_worker, NprocArgs(2, work, fail=False)) is None  # returns: every worker exited 0
    assert sorted(p.name for p in work.iterdir()) == ["rank0.txt", "rank1.txt"]
    assert "spawned worker finalized" not in capfd.readouterr().err
    monkeypatch.chdir(tmp_path)  # no run directory: torch's output is kept under ./runs/failures/
    with pytest.raises(SystemExit) as failed:
        launch(nproc_worker, NprocArgs(2, work, fail=True))
    assert failed.value.code == 1
    err = capfd.readouterr().err
    assert "rank 1 failed on purpose" in err and "error: rank 1 " in err  # its traceback, then the launcher's line
    assert list((tmp_path / "runs" / "failures").iterdir())
