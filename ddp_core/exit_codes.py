"""Every exit code ddp-lab states, in one place: what a worker, torchrun and ``python -m ddp_core.runs`` read.

| code | meaning | what to do |
|---|---|---|
| 0 | finished (or stopped at ``--stop-at-step``, checkpoint written, no metrics.json) | \
continue a stopped run with ``--resume`` |
| 1 | a failure with a traceback (Python's own code; under the launcher: the raising rank's, once, then one line \
naming it), or a rendezvous that failed | read the traceback or the one line after it |
| 2 | bad configuration, found before training: one line naming the flag or variable and the fix | fix it and relaunch |
| 3 | diverged: a non-finite loss or weight; the last good checkpoint is kept | \
lower the learning rate, ``--resume`` from it |
| 4 | a preflight check failed; its table names the check and the fix | fix it and run the preflight again |
| 5 | replicas diverged: the ranks' models differ (``--check-replicas-every``); the last checkpoint, of agreeing \
replicas, is kept | ``--resume``; if the same rank differs again, suspect its GPU |
| 74 | storage failure (a full disk, a folder that refuses writes); every complete checkpoint is kept | \
free space, ``--resume`` |
| 120 | output lost: stdout or stderr could not be flushed at exit (CPython's own code) | \
keep the console or log file open |
| 124 | a rank hung: a collective timed out (``DIST_TIMEOUT_S``); one line names the rank(s) that did not arrive \
and where the others waited, one line per rank its line of Python, the last the files | read the hung rank's line \
and the stack and flight-recorder files (docs/faults.md: Finding a hang) |
| 130 | stopped by Ctrl-C before any checkpoint was written (under the launcher, during start-up); one line, \
no traceback | relaunch: there is nothing to resume |
| 137 | a rank was killed (SIGKILL: often the out-of-memory killer; another signal N: 128+N); one line names the \
rank, its host, the step and the checkpoint | free memory or lower ``--batch-size``, then ``--resume`` |
| 143 | stopped on request (SIGTERM, Ctrl-C) after a checkpoint; the launcher's line names it (a SIGTERM during \
start-up: none, and its line says so) | ``--resume`` |
"""

from __future__ import annotations

FAILED_EXIT_CODE = 1
CONFIG_ERROR_EXIT_CODE = 2
DIVERGED_EXIT_CODE = 3
PREFLIGHT_FAILED_EXIT_CODE = 4
REPLICAS_DIVERGED_EXIT_CODE = 5
STORAGE_EXIT_CODE = 74  # EX_IOERR in sysexits.h: "an error occurred while doing I/O on some file"
FLUSH_FAILED_EXIT_CODE = 120  # what CPython exits with when it cannot flush stdout or stderr at exit
HUNG_EXIT_CODE = 124  # what timeout(1) exits with when the command it ran timed out
KILLED_EXIT_CODE_BASE = 128  # a rank killed by signal N: the job exits 128 + N, as a shell reports it (137: SIGKILL)
STOPPED_EXIT_CODE = 143  # 128 + SIGTERM, what schedulers read as "terminated"; here: checkpoint written

# What the runs table calls a run that left with each code (any other: failed).
STATUS_OF_EXIT_CODE = {
    0: "finished",
    DIVERGED_EXIT_CODE: "diverged",
    REPLICAS_DIVERGED_EXIT_CODE: "diverged",
    STOPPED_EXIT_CODE: "stopped",
}

# A worker that ends with one of these meant to: it printed its one line and closed its files.
FINISHED_EXIT_CODES = frozenset(
    {
        0,
        CONFIG_ERROR_EXIT_CODE,
        DIVERGED_EXIT_CODE,
        PREFLIGHT_FAILED_EXIT_CODE,
        REPLICAS_DIVERGED_EXIT_CODE,
        STORAGE_EXIT_CODE,
        STOPPED_EXIT_CODE,
    }
)
