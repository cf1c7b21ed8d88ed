"""Two ranks hang in mismatched collectives, DDP's classic hang (tests/e2e/test_launch_paths.py).

    python -m tests.e2e.hang_probe --out DIR [--nproc 2]

Each rank forms a gloo group (a 10-minute timeout), writes ``DIR/rank<RANK>.ready``, then waits inside
torch: rank 0 in an all_reduce, rank 1 in a receive from rank 0. Neither returns to Python, so a stop
signal's handler never runs (``GracefulStop``, as in a training loop): only SIGKILL ends them.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_core.process.launch import launch
from ddp_core.process.preemption import GracefulStop


def hang(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    with GracefulStop():
        rank = dist.get_rank()
        (Path(args.out) / f"rank{rank}.ready").touch()
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
