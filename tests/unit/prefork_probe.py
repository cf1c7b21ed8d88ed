"""What a process sees of how it was started, then an ending chosen by its argument; run by test_prefork.py
under ``python -m`` twice, once with the real interpreter and once with tests.prefork's, whose answers must agree.

    python -m tests.unit.prefork_probe show|exit3|exit-message|raise|interrupt|thread|stdin
    python -m tests.unit.prefork_probe wait-for-sigterm|sigkill-self|python-child|spawn|spawn-and-wait
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time


def spawned(rank: int, launcher: int) -> None:
    """A worker as torch.multiprocessing spawns it (the ``--nproc`` path): what it sees, then exit 5."""
    seen = {"argv": sys.argv, "main": __name__, "parent_is_launcher": os.getppid() == launcher}
    seen.update(probe=os.environ.get("PROBE"), site=os.environ.get("SITE_RAN"))
    seen["forked"] = "tools.contract" in sys.modules  # imported by the fork server (tests.prefork), not by this
    print(json.dumps(seen), flush=True)
    sys.exit(5)


def spawned_waits(rank: int) -> None:
    print(f"worker {os.getpid()}", flush=True)
    time.sleep(600)  # until the launcher's death takes it (PR_SET_PDEATHSIG): the test's kill decides, not this


if __name__ == "__main__":
    how = sys.argv[1]
    print(
        json.dumps(
            {
                "argv": sys.argv,
                "name": __name__,
                "cwd": os.getcwd(),
                "path": sys.path[:2],
                "probe": os.environ.get("PROBE"),
                "stdout_fd": sys.stdout.fileno(),
                "stdin": None if sys.stdin is None else sys.stdin.fileno(),
            }
        ),
        flush=True,
    )
    atexit.register(print, "atexit ran", flush=True)
    if how == "exit3":
        sys.exit(3)
    elif how == "exit-message":
        sys.exit("a message for stderr")
    elif how == "raise":
        raise ValueError("the probe's uncaught error")
    elif how == "interrupt":
        raise KeyboardInterrupt
    elif how == "thread":  # a non-daemon thread outlives the main one: it is joined before the atexit handlers run
        main_done = threading.Event()
        threading.Thread(target=lambda: (main_done.wait(), print("thread joined", flush=True))).start()
        print("main done", flush=True)
        main_done.set()
    elif how == "stdin":
        print(f"read {sys.stdin.read()!r}", flush=True)
    elif how == "wait-for-sigterm":
        signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(7))
        print(f"waiting {os.getpid()}", flush=True)
        while True:
            signal.pause()
    elif how == "sigkill-self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "python-child":  # what a launcher does: start sys.executable -m ...
        child = subprocess.run(
            [sys.executable, "-m", "tests.unit.prefork_probe", "exit3"], capture_output=True, text=True
        )
        print(f"child exited {child.returncode}", flush=True)
    elif how == "spawn":  # a worker as the --nproc path starts it (torch only here: the other cases start quickly)
        import torch.multiprocessing as mp

        try:
            mp.start_processes(spawned, args=(os.getpid(),), nprocs=1, start_method="spawn")
        except mp.ProcessExitedException as error:
            print(f"worker exited {error.exit_code}", flush=True)
    elif how == "spawn-and-wait":
        import torch.multiprocessing as mp

        mp.start_processes(spawned_waits, nprocs=1, start_method="spawn")
