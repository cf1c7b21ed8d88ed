"""Two ranks hang in mismatched collectives, DDP's classic hang (tests/e2e/test_launch_paths.py).

    python -m tests.e2e.hang_probe --out DIR [--nproc 2]

Each rank forms a gloo group (a 10-minute timeout), writes ``DIR/rank<RANK>.ready`` (the threads it was given, as
tests.e2e.threads_probe writes them), then waits inside
torch: rank 0 in an all_reduce, rank 1 in a receive from rank 0. Neither returns to Python, so a stop
signal's handler never runs (``GracefulStop``, as in a training loop): only SIGKILL ends them.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_core.process.launch import launch
from ddp_core.process.preemption import GracefulStop
from tests.e2e.threads_probe import threads_given


def hang(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    with GracefulStop():
        rank = dist.get_rank()
        written = Path(args.out) / f"rank{rank}.writing"
        written.write_text(json.dumps(threads_given()))
        written.replace(written.with_suffix(".ready"))  # whole when it appears: the test reads it as soon as it does
        tensor = torch.zeros(1)
        if rank == 0:
            dist.all_reduce(tensor)
        else:
            dist.recv(tensor, src=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--nproc", type=int, default=1)
    launch(hang, parser.parse_args())  # type: ignore[type-var]


if __name__ == "__main__":
    main()
