"""Two workers that end as a refused run can: rank 0 prints its one line, rank 1 then exits 2 first.

torchrun sees rank 1 leave while rank 0 is still alive, logs closing it ("Sending process N closing signal
SIGTERM") and ends it with SIGTERM: the worker exit codes are {2, -SIGTERM}. Rank 1 waits for rank 0's
word in torchrun's store, so the order is forced, not left to timing.

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m tests.e2e.said_then_closed
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE

LINE = "error: the one line that says why"

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    if rank == 0:
        print(LINE, file=sys.stderr, flush=True)
        store.set("said", "yes")
        signal.pause()  # until torchrun's SIGTERM ends it
    store.wait(["said"])
    os._exit(CONFIG_ERROR_EXIT_CODE)
