"""Leave a worker whose work is complete without the interpreter's finalization, where gloo can abort it.

    if __name__ == "__main__":
        from ddp_core.process.exit import run_and_exit
        run_and_exit(main)

torch 2.14.1's gloo teardown can abort a finished worker (SIGABRT, "terminate called without an active
exception"; docs/design.md, "Gloo teardown"); ``os._exit`` never reaches it. Only a worker that ended as it meant
to leaves that way: returned (0), or exited with one of ddp-lab's stated codes after its one line
(``ddp_core.exit_codes``). An exception, or a ``SystemExit`` with a message, propagates unchanged.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn

from ddp_core.exit_codes import FINISHED_EXIT_CODES, FLUSH_FAILED_EXIT_CODE


def leave(code: int) -> NoReturn:
    """End the process with ``code``: a normal exit's first steps, then ``os._exit`` instead of finalization.

    Runs what ``Py_FinalizeEx`` runs before it starts tearing objects down (join non-daemon threads, then
    the atexit handlers: logging's flush and close, DataLoader and torch.compile worker shutdown), then
    flushes stdout and stderr. Files the caller opened must be closed by then: no garbage collection
    comes to flush them. Never call it in a test process: it ends pytest too.
    """
    if threading.current_thread() is threading.main_thread():
        threading._shutdown()  # private, but exactly the interpreter's own first exit step (CPython 3.11)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: output was lost, so "complete" is not true
            code = code or FLUSH_FAILED_EXIT_CODE
    os._exit(code)


def requested_code(stop: SystemExit) -> int | None:
    """The exit status a SystemExit asks for; None for a message (Python prints it and exits 1)."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else None


def _launcher_reports(error: BaseException) -> bool:
    """Under ``ddp_core.torchrun`` (``DDP_LAB_JOB_DIR``), an exception torch's ``@record`` kept in this worker's error
    file is printed by the launcher, once per job and from the rank that raised it; the other ranks' follow-on
    errors (a peer that exited, a collective that timed out) stay in the file (docs/decisions.md)."""
    from ddp_core.process.heartbeat import JOB_DIR_ENV

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return (
        isinstance(error, Exception)
        and bool(os.environ.get(JOB_DIR_ENV))
        and bool(error_file)
        and os.path.isfile(error_file)  # type: ignore[arg-type]
        and os.path.getsize(error_file) > 0  # type: ignore[arg-type]
    )


def record_exit(code: int) -> None:
    """``ddp_core.output.run.record_exit``, where a run was started in this process: starting one imported that module.
    A tool that started none (``python -m ddp_core.runs``) then leaves without importing torch for it."""
    run = sys.modules.get("ddp_core.output.run")
    if run is not None:
        run.record_exit(code)


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Run an entry point's ``main()`` and end the process; only from a ``__main__`` block or a spawned worker.

    Whatever the ending, a run this process started as rank 0 records it in its manifest.json first.
    """
    try:
        main()
    except SystemExit as stop:
        code = requested_code(stop)
        record_exit(1 if code is None else code)
        if code not in FINISHED_EXIT_CODES:
            raise
        leave(code)
    except BaseException as error:
        record_exit(1)  # a traceback follows: Python's exit status for it is 1
        if _launcher_reports(error):
            leave(1)
        raise
    record_exit(0)
    leave(0)
