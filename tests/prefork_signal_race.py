"""How often the test suite's python stand-in (tests/prefork.py) misreports a child that a signal met as it ended.

    python -m tests.prefork_signal_race --runs 300 --busy 4

The stand-in forwards the signals a launcher sends to its forked child and then exits as the child did.
torchrun SIGTERMs every worker once one has stopped; a worker that had just exited on its own then got
the signal forwarded to a process that no longer existed, and the stand-in died of that error with exit 1
instead of the child's 143 (seen once in a full suite run: a 4-process stop-and-resume test failed). Each
run here starts the stand-in on a module (tests/exit_143.py) that prints a line and exits 143, and sends the
stand-in SIGTERM as soon as the line arrives, while the child is ending; it counts the runs whose exit status
is neither 143 nor death by the signal. The window (between the fork server reaping the child and the stand-in
reading its status) is microseconds on a quiet machine: ``--busy N`` loads the cores with N spinning
processes, as a full suite run does.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from tests import prefork


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--busy", type=int, default=4, help="spinning processes beside the runs")
    args = parser.parse_args(argv)
    shim, wrong = prefork.python(), []
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        _stress(shim, args.runs, wrong)
    finally:
        for process in spinning:
            process.kill()
    print(f"{len(wrong)} of {args.runs} runs exited otherwise than 143 (SIGTERM as the child ends, {args.busy} busy)")
    for returncode, last in wrong[:3]:
        print(f"   exit {returncode}: {last[0]}")
    return 0


def _stress(shim: str, runs: int, wrong: list) -> None:
    for _ in range(runs):
        command = [shim, "-m", "tests.exit_143"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        process.stdout.readline()  # the child is ending now: the race this measures
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        if process.returncode not in (143, -signal.SIGTERM):
            wrong.append((process.returncode, stderr.strip().splitlines()[-1:] or [""]))


if __name__ == "__main__":
    sys.exit(main())
