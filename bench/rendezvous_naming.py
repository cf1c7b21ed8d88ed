"""What a launcher spends naming the callers of torch's rendezvous events: torch's ``get_method_name``
(``inspect.stack()``, twice a call) against the frame-based one ``ddp_core.torchrun`` installs, side by side.

    python -m bench.rendezvous_naming                  # 5 rounds of 10 calls each (a launch records about 10)
    python -m bench.rendezvous_naming --depth 40 --rounds 9

Both are called from the same stack, ``--depth`` frames deep (a launcher's rendezvous runs about 25 below
``main``), in this process with ddp_core.torchrun imported (as a launcher has it). Each round times ``--calls``
calls of each, in alternating order; reported: milliseconds per launch's worth of calls, median and range, and
the ratio torch / frame per round. Both must name the same caller. Not in ``make bench``: a few seconds.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from ddp_core import torchrun
from ddp_core.config import option, parse_args
from ddp_core.errors import exits_with_one_line


@dataclass
class RendezvousNamingArgs:
    rounds: int = option(5, "rounds, each timing both functions", minimum=1)
    calls: int = option(10, "calls of each per round (a launch's rendezvous events)", minimum=1)
    depth: int = option(25, "frames below the caller, as in a launcher", minimum=1, maximum=500)


def at_depth(depth: int, work: Callable[[], float]) -> float:
    return work() if depth <= 1 else at_depth(depth - 1, work)


def timed(name_of: Callable[[int], str], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        name_of(2)
    return (time.perf_counter() - started) * 1000


@exits_with_one_line
def main(argv: list[str] | None = None) -> int:
    args = parse_args(RendezvousNamingArgs, argv, description=__doc__.splitlines()[0])
    torchrun.rendezvous_events_name_their_caller_cheaply()
    frame_based = dynamic_rendezvous.get_method_name
    torchs = frame_based.ddp_lab_original
    names = at_depth(args.depth, lambda: (torchs(1), frame_based(1)))
    if names[0] != names[1]:
        raise SystemExit(f"error: the two name different callers: {names}")
    print(
        f"naming rendezvous callers: {args.calls} calls a round, {args.depth} frames deep, "
        f"{len(sys.modules)} modules loaded",
        flush=True,
    )
    times: dict[str, list[float]] = {"torch": [], "frame": []}
    for number in range(args.rounds):
        order = [("torch", torchs), ("frame", frame_based)]
        for label, function in order if number % 2 == 0 else order[::-1]:
            times[label].append(at_depth(args.depth, lambda f=function: timed(f, args.calls)))
    for label, values in times.items():
        print(f"  {label}: {statistics.median(values):.3f} ms ({min(values):.3f}-{max(values):.3f})")
    ratios = [slow / fast for slow, fast in zip(times["torch"], times["frame"], strict=True)]
    print(f"torch / frame: median {statistics.median(ratios):.0f}x ({min(ratios):.0f}-{max(ratios):.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
