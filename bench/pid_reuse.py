"""A killed run's pid, reused by a process that ends while the run is read: how often the run reads "running".

    python -m bench.pid_reuse --trials 500

A run records its rank-0 process (pid and start time, ddp_core.output.process_identity); the runs table and a
study's next start read a run with no exit code as "running" while that process is alive, and a study refuses to
start a run that reads so. Once the killed run's process is gone, its pid can be handed to another process: the
start time tells them apart, provided the other process is still there when its start time is read. On a busy
machine pids come round quickly (32,768 of them by default, threads included), and a process that ends between the
two looks left nothing to read, which counted as alive (a study's end-to-end test read a killed run as running for
one poll in a suite run).

Each trial forks a child that exits at once, reaped by a thread as soon as it does, and reads, again and again until
the pid is gone, the identity of a run whose process had that pid and another start time (a run killed earlier).
Every read must say "not alive". Counted: the reads that said alive, and the trials with one. Exit status 1 if any.
Not in ``make bench``: about 5 s per 100 trials on the 2-core machine.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass

from ddp_core.config import option
from ddp_core.output.process_identity import alive_here
from ddp_core.process.entry import command_main


@dataclass
class PidReuseArgs:
    trials: int = option(500, "children forked, each read until its pid is gone", minimum=1)


def trial() -> tuple[int, int]:
    """(reads that said alive, reads) of a dead run whose pid a short-lived child holds."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    reaper = threading.Thread(target=os.waitpid, args=(pid, 0))
    reaper.start()
    killed_run = {"host": socket.gethostname(), "pid": pid, "pid_start": "0"}  # no process starts at tick 0 but init
    wrong = reads = 0
    while True:
        reads += 1
        wrong += bool(alive_here(killed_run))
        if not reaper.is_alive():  # reaped: one more read sees the pid gone
            reads += 1
            wrong += bool(alive_here(killed_run))
            break
    reaper.join()
    return wrong, reads


def run_bench(args: PidReuseArgs) -> int:
    sys.setswitchinterval(1e-5)  # the reaper thread runs as soon as its child is gone, not after 5 ms of reads
    print(f"a dead run's pid held by a process that ends while read: {args.trials} trials", flush=True)
    wrong = reads = trials_wrong = 0
    for _ in range(args.trials):
        said_alive, read = trial()
        wrong += said_alive
        reads += read
        trials_wrong += said_alive > 0
    print(f"Result: read as alive {wrong} times in {reads} reads; trials with one: {trials_wrong} of {args.trials}")
    return 1 if wrong else 0


main = command_main(PidReuseArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
