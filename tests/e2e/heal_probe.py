"""A stand-in worker for ``--heal``'s launcher side (tests/e2e/test_heal_launch.py), standard library only.

Each incarnation writes ``rank<RANK>.<n>`` (n: DDP_LAB_HEAL_REPLACEMENT, 0 for the first) into HEAL_PROBE_DIR: its
pid, the heal variables, whether the lighthouse accepts a connection. FIFOs order the job, no sleeps: rank 1's
first HEAL_PROBE_KILLS incarnations wait for the others' token in ``ready`` (they have written their file), then
SIGKILL themselves; the survivors wait in ``done<rank>`` until rank 1's replacement has written its file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from urllib.parse import urlsplit

from ddp_core.process import heartbeat

VICTIM = 1


def lighthouse_answers(address: str) -> bool:
    where = urlsplit(address)
    try:
        socket.create_connection((where.hostname, where.port), timeout=10).close()
    except (OSError, TypeError, ValueError):
        return False
    return True


def main() -> None:
    folder = Path(os.environ["HEAL_PROBE_DIR"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("DDP_LAB_HEAL_REPLACEMENT", "0"))
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE", "")
    record = {
        "pid": os.getpid(),
        "heal": os.environ.get("DDP_LAB_HEAL"),
        "lighthouse": lighthouse,
        "answers": lighthouse_answers(lighthouse),
    }
    (folder / f"rank{rank}.{incarnation}.tmp").write_text(json.dumps(record))
    (folder / f"rank{rank}.{incarnation}.tmp").rename(folder / f"rank{rank}.{incarnation}")
    heartbeat.started(folder)  # a step taken: only a worker that trained is replaced
    heartbeat.beat(1)
    if rank == VICTIM:
        if incarnation < int(os.environ["HEAL_PROBE_KILLS"]):
            if incarnation == 0:
                tokens = 0
                while tokens < world - 1:  # each survivor's one token; EOF whenever no survivor has it open
                    with open(folder / "ready", "rb") as ready:
                        tokens += len(ready.read())
            os.kill(os.getpid(), signal.SIGKILL)
        for other in range(world):
            if other != VICTIM:
                with open(folder / f"done{other}", "wb") as done:
                    done.write(b"x")
        return
    with open(folder / "ready", "wb") as ready:
        ready.write(b"x")
    with open(folder / f"done{rank}", "rb") as done:
        done.read()


if __name__ == "__main__":
    main()
