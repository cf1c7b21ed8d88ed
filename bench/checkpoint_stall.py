"""How long a checkpoint save stalls training, written in the background against written in place:
`python -m bench.checkpoint_stall` (seconds; part of `make recovery`).

The state is CIFAR10 ``--model small``'s as a run checkpoints it: the model, SGD with Nesterov momentum after a step
(a buffer per parameter), every rank's random streams for 3 ranks. ``--saves`` saves of each kind, alternating (in
place; in the background by a writer thread; by the writer process, ``--checkpoint-writer``), one torch thread (as a
worker under torchrun), into a temporary run folder on the same disk as the runs (``--dir``): ``CheckpointDir.save``
timed from its call to its return, which is what the training loop waits for (metrics.json's
``checkpoint_stall_ms``). A background save returns once the state is copied and handed over; the write itself
(``wait``) is timed apart and not counted, as the loop trains meanwhile. A background save that stalls more than
``--limit`` of the in-place one's median exits 1.

A write behind training by a thread shares the process's GIL with the loop. While each background write is in
flight, the bench's own thread dispatches tiny torch ops, as an eager loop dispatches its kernels, and adds up its
gaps over 1 ms between two ops: the time the writer held the GIL. The same loop for as long beside no write is the
machine's own noise.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ddp_core.config import option
from ddp_core.layout import STEP_GLOB
from ddp_core.output.background_write import WRITES
from ddp_core.output.checkpoint import PROCESS, THREAD, CheckpointDir
from ddp_core.output.writer_process import PROCESS_WRITER
from ddp_core.process.entry import command_main
from ddp_core.training.seed import get_rng_state
from experiments.cifar10_models import build_model


@dataclass
class StallArgs:
    saves: int = option(20, "saves of each kind (in place, background), alternating", minimum=1)
    model: str = option("small", "CIFAR10 model whose state is saved", choices=("small", "resnet18"))
    dir: str = option("", "where the checkpoints go (default: a temporary folder)")
    limit: float = option(0.10, "the most a background save may stall, as a fraction of an in-place one's", above=0)
    json: bool = option(False, "print every figure as JSON")


def cifar10_state(model_name: str) -> dict[str, Any]:
    """The named states a CIFAR10 run checkpoints, after one optimizer step (momentum buffers exist)."""
    torch.manual_seed(0)
    model = build_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    model(torch.randn(8, 3, 32, 32)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": [get_rng_state()] * 3}


KINDS = ("in place", THREAD, PROCESS)  # a save written in place, or behind the loop by a thread or by a process


def measure(args: StallArgs, folder: Path) -> dict[str, Any]:
    state = cifar10_state(args.model)
    stalls: dict[str, list[float]] = {kind: [] for kind in KINDS}
    writes: dict[str, list[float]] = {THREAD: [], PROCESS: []}
    lost: dict[str, list[float]] = {THREAD: [], PROCESS: [], "none": []}
    PROCESS_WRITER.start()  # as a run starts it: it has imported torch by the first save
    warm = CheckpointDir(folder / "warm-up", keep=1, background=True, writer=PROCESS)
    warm.save(0, lambda: state)
    warm.wait()
    for index in range(len(KINDS) * args.saves):
        kind = KINDS[index % len(KINDS)]
        background = kind != "in place"
        checkpoints = CheckpointDir(
            folder / kind.replace(" ", "_"), keep=2, background=background, writer=kind if background else THREAD
        )
        began = time.perf_counter()
        checkpoints.save(index + 1, lambda: state, {"experiment": "cifar10"})
        stalls[kind].append(time.perf_counter() - began)
        if background:
            began = time.perf_counter()
            lost[kind].append(dispatch_gaps(lambda: WRITES.in_flight))  # as the loop trains meanwhile
            checkpoints.wait()  # here the next save must not overlap it
            writes[kind].append(time.perf_counter() - began)
            until = time.perf_counter() + writes[kind][-1]
            lost["none"].append(dispatch_gaps(lambda: time.perf_counter() < until))
    PROCESS_WRITER.close()
    size = next((folder / "in_place").glob(STEP_GLOB)).stat().st_size
    return {"stall_s": stalls, "background_write_s": writes, "dispatch_gaps_s": lost, "bytes": size}


GAP_S = 0.001  # a tiny op takes microseconds: a longer gap between two is time without the GIL (or the CPU)
GAP_MS = f"{1000 * GAP_S:g}"


def dispatch_gaps(going_on: Callable[[], bool]) -> float:
    """Seconds lost in gaps over ``GAP_S`` by this thread dispatching tiny torch ops while ``going_on()``."""
    x, lost, last = torch.zeros(16), 0.0, time.perf_counter()
    while going_on():
        x.add_(1.0)
        now = time.perf_counter()
        lost += now - last if now - last > GAP_S else 0.0
        last = now
    return lost


def summary(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f} ms [{1000 * min(values):.1f}-{1000 * max(values):.1f}]"


def run_bench(args: StallArgs) -> dict[str, Any]:
    torch.set_num_threads(1)  # as each worker under torchrun (OMP_NUM_THREADS=1)
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-stall-", dir=args.dir or None) as folder:
        result = measure(args, Path(folder))
    in_place = statistics.median(result["stall_s"]["in place"])
    result["ratio"] = {kind: statistics.median(result["stall_s"][kind]) / in_place for kind in (THREAD, PROCESS)}
    if args.json:
        print(json.dumps({"args": asdict(args), **result}, indent=1))
    else:
        stalls, writes, gaps = result["stall_s"], result["background_write_s"], result["dispatch_gaps_s"]
        print(
            f"\nCheckpoint stall, CIFAR10 --model {args.model} ({result['bytes'] / 2**20:.1f} MiB a file), "
            f"{args.saves} saves of each kind, alternating; median [min-max]"
        )
        print(f"| save | training stalled | the write, behind training | a dispatching thread's gaps > {GAP_MS} ms |")
        print("|---|---|---|---|")
        print(f"| in place (--no-checkpoint-async) | {summary(stalls['in place'])} | - | - |")
        for kind in (THREAD, PROCESS):
            print(
                f"| background, --checkpoint-writer {kind} | {summary(stalls[kind])} | {summary(writes[kind])} | "
                f"{summary(gaps[kind])} |"
            )
        print(f"| (as long beside no write) | | | {summary(gaps['none'])} |")
        for kind in (THREAD, PROCESS):
            print(f"background by a {kind} / in place: {result['ratio'][kind]:.3f} of the stall (limit {args.limit:g})")
    if max(result["ratio"].values()) > args.limit:
        raise SystemExit(1)
    return result


main = command_main(StallArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
