"""A worker for the restart test: rank 1 dies right after the first attempt's group is formed.

torchrun --max-restarts=1 then restarts every worker; the second attempt must form a new group in the
same rendezvous store (docs/design.md, "Restarts and the shared rendezvous store") and finish a collective.
"""

import os

import torch
import torch.distributed as dist

from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.group import DistConfig, process_group


def main() -> None:
    env = DistEnv.from_environ()
    with process_group(DistConfig(backend="gloo", timeout_s=30), env):
        total = torch.tensor([env.rank + 1.0])
        dist.all_reduce(total)
        if env.restart_count == 0 and env.rank == 1:
            os._exit(17)  # die without tearing down, as a killed worker would
        dist.barrier()
        expected = env.world_size * (env.world_size + 1) / 2
        assert total.item() == expected, total
        if env.rank == 0:
            print(f"attempt {env.restart_count} all_reduce {total.item():g} ok", flush=True)


if __name__ == "__main__":
    main()
