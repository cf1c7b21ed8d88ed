"""One rank of the nccl correctness check in test_nccl.py (run under torchrun, one process per GPU).

Each rank's input depends on its rank, so every result has a closed form; a mismatch raises (exit 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_core.distributed.group import DistConfig, process_group


def check(rank: int, world: int, device: torch.device) -> None:
    # all_reduce: sum over ranks of (rank + 1) * [1, 2, 3] is world(world+1)/2 * [1, 2, 3]
    x = (rank + 1) * torch.arange(1, 4, dtype=torch.float32, device=device)
    dist.all_reduce(x)
    expected = world * (world + 1) / 2 * torch.arange(1, 4, dtype=torch.float32)
    assert torch.equal(x.cpu(), expected), f"all_reduce on rank {rank}: {x.tolist()} != {expected.tolist()}"

    # all_gather: rank r sends [10r, 10r + 1]; everyone receives them in rank order
    mine = torch.tensor([10.0 * rank, 10.0 * rank + 1], device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    expected_gather = torch.tensor([[10.0 * r, 10.0 * r + 1] for r in range(world)])
    assert torch.equal(torch.stack(gathered).cpu(), expected_gather), (
        f"all_gather on rank {rank}: {torch.stack(gathered).tolist()}"
    )


def main() -> None:
    with process_group(DistConfig(backend="nccl", timeout_s=120)) as ctx:
        check(ctx.rank, ctx.world_size, ctx.device)
        if ctx.rank == 0:
            print(f"nccl all_reduce and all_gather ok on {ctx.world_size} rank(s)", flush=True)


if __name__ == "__main__":
    main()
