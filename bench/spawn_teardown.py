"""The spawn path's teardown, for `bench.stress --launcher spawn`: N processes started by torch.multiprocessing.

    python -m bench.spawn_teardown --nproc 4 --exit leave     # as tests/distributed/harness.py's children
    python -m bench.spawn_teardown --nproc 4 --exit return    # as they did before: interpreter finalization

Each child sets torchrun's variables, enters ddp_core's ``process_group`` (gloo), takes one DDP step of
a tiny Linear, and passes a barrier, exactly as a harness worker does; then it leaves through
``ddp_core.process.exit.leave(0)`` or returns to torch.multiprocessing, which exits through the
interpreter's finalization, where torch 2.14's gloo threads can abort a process whose work is done
(docs/design.md, "Gloo teardown"). The parent exits 1 when a child did not exit 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ddp_core.config import MAX_NPROC, option
from ddp_core.distributed.group import DistConfig, process_group
from ddp_core.process.entry import command_main
from ddp_core.process.exit import leave
from ddp_core.process.launch import free_port


def child(rank: int, nproc: int, port: int, exit_via: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    with process_group(DistConfig(backend="gloo", timeout_s=60)):
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        model(torch.ones(8, 4)).sum().backward()  # one gradient all-reduce
        dist.barrier()
    if exit_via == "leave":
        leave(0)


@dataclass
class SpawnTeardownArgs:
    nproc: int = option(4, "processes to spawn", minimum=1, maximum=MAX_NPROC)
    exit: str = option(
        "leave",
        "how a finished child exits: leave (ddp_core.process.exit) or return (finalization)",
        choices=("leave", "return"),
    )


def run_bench(args: SpawnTeardownArgs) -> None:
    try:
        mp.start_processes(child, args=(args.nproc, free_port(), args.exit), nprocs=args.nproc, start_method="spawn")
    except mp.ProcessExitedException as error:
        print(
            f"error: a spawned child exited with {error.exit_code} (signal {-error.exit_code} if negative)", flush=True
        )
        raise SystemExit(1) from None


main = command_main(SpawnTeardownArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
