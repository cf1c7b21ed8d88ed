"""The plain-PyTorch control for `bench.stress`: no ddp_core, only what every DDP script does.

    torchrun --standalone --nproc-per-node=4 -m bench.teardown_control

Init gloo from torchrun's variables, wrap a tiny Linear in DDP, one forward/backward (one all-reduce),
barrier, destroy the group, and leave the way any script does: through the interpreter's normal exit.
If this aborts at exit as often as ddp-lab's toy did, the abort is torch's, not ddp-lab's (docs/design.md,
"Gloo teardown").
"""

import torch
import torch.distributed as dist
from torch import nn

if __name__ == "__main__":
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    model(torch.ones(8, 4)).sum().backward()  # DDP all-reduces the gradients here
    dist.barrier()
    dist.destroy_process_group()
