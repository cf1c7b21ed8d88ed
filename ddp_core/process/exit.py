"""Leave a finished worker without the interpreter's finalization, where gloo's teardown can abort it
(docs/design.md, "Gloo teardown"). Only a return or a stated exit code leaves that way; anything else propagates.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn

from ddp_core.exit_codes import FINISHED_EXIT_CODES, FLUSH_FAILED_EXIT_CODE


def leave(code: int) -> NoReturn:
    """End the process with ``code``: what ``Py_FinalizeEx`` runs before its teardown (join threads, atexit
    handlers), flush stdout and stderr, then ``os._exit``. Never in a test process: it ends pytest too."""
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
    """Under ``ddp_core.torchrun``, an exception ``@record`` kept in this worker's error file: the launcher prints
    it, once per job."""
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
    """``ddp_core.output.run.record_exit`` if a run started here imported it (else torch stays unimported)."""
    run = sys.modules.get("ddp_core.output.run")
    if run is not None:
        run.record_exit(code)


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main()`` and end the process, recording the exit in a run's manifest.json first; only from a
    ``__main__`` block or a spawned worker."""
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
