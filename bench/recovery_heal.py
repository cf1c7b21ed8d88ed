"""``python -m bench.recovery --heal``: what a failure costs when only the dead worker is replaced (docs/faults.md).

The launcher runs with ``--heal``: a killed worker's client starts a replacement, the survivors keep their processes
and abandon the step the peer died in, and the replacement receives the state from a live peer through torchft, then
every rank retries that step. torchrun never restarts the group (every event's restart is 0), so a rank's current
worker is the latest process that took a first step for it; the next kill is due ``--every`` seconds after the last
replacement took its first step.

Per fault, each from the kill (the phases overlap: the survivors see the failure while the client replaces the
worker): detection (the first survivor's ``abandoned``), the client's replacement (``replaced``: it saw its worker
die), the replacement up (its ``imported``: forked from the warm parent, or a new interpreter with ``--cold``), the
state received (its ``healed``) and the first step (its ``first_step``, the abandoned step retried and committed:
the survivors commit no step from the kill until then, so this is what they lost; the steps they abandoned are
counted). Per run: the figures of bench/recovery.py (lost per fault against the fault-free ``--heal`` twin,
goodput, bitwise), whether the survivors kept their processes (each rank had one worker process more than its
kills), and the fault-free ``--heal`` run's steps per second against a fault-free run without ``--heal`` run beside
it (the quorum each step starts with, through the lighthouse).
"""

from __future__ import annotations

import collections
from typing import Any

from bench.recovery_runs import Fault, Job, RecoveryArgs, spread, steps_of, training, workers

# the columns of the per-fault breakdown: seconds from the kill to the event (ddp_core/process/timeline.py)
PHASES = (
    ("detection", "abandoned"),
    ("client's replacement", "replaced"),
    ("replacement up", "imported"),
    ("state received", "healed"),
    ("first step", "first_step"),
)


def scene(
    events: list[dict[str, Any]], kills: list[Fault], nproc: int
) -> tuple[float | None, dict[int, int], str | None]:
    """When the group trained again after the last kill (its replacement's first step; None: not yet), each rank's
    current worker (the latest to take a first step for it) and the heartbeat folder."""
    up = training(events, 0, nproc)
    if kills:
        last = kills[-1]
        again = [e["t"] for e in events if e["event"] == "first_step" and e["rank"] == last.rank and e["t"] > last.kill]
        up = again[0] if again else None
    pids = {e["rank"]: e["pid"] for e in events if e["event"] == "first_step"}  # oldest first: the latest wins
    return up, pids, workers(events, 0)[1]


def measure_faults(kills: list[Fault], events: list[dict[str, Any]]) -> None:
    """Each fault's phases, from the events between its kill and the next one."""
    for index, fault in enumerate(kills):
        end = kills[index + 1].kill if index + 1 < len(kills) else float("inf")
        window = [e for e in events if fault.kill <= e["t"] < end]
        survivors = [e for e in window if e["event"] == "abandoned" and e["rank"] != fault.rank]
        replacement = [e for e in window if e["rank"] == fault.rank and e["pid"] != fault.pid]
        for name, event in PHASES:
            times = [e["t"] for e in (survivors if event == "abandoned" else replacement) if e["event"] == event]
            if times:
                fault.phases[name] = times[0] - fault.kill
        fault.steps_lost = 0  # the abandoned steps are retried before the first step: in its time already
        fault.lost_s = fault.phases.get("first step")
        first = fault.kill + fault.lost_s if fault.lost_s is not None else end
        fault.abandoned = len({(e["step"], bool(e.get("pause"))) for e in survivors if e["t"] <= first})


def survivors_kept(job: Job) -> bool:
    """Whether only the killed workers were replaced: each rank had one process more than its kills (the clients'
    ``replaced`` is the client's pid, not a worker's)."""
    pids: dict[int, set[int]] = collections.defaultdict(set)
    for event in job.events:
        if event["rank"] is not None and event["event"] != "replaced":
            pids[event["rank"]].add(event["pid"])
    kills = collections.Counter(fault.rank for fault in job.faults)
    return bool(pids) and all(len(pids[rank]) == 1 + kills[rank] for rank in pids)


def summarise(runs: dict[str, Job]) -> dict[str, Any]:
    """What bench.recovery's summary lacks under --heal."""
    plain = steps_of(runs["plain"]) / runs["plain"].train_s
    heal = steps_of(runs["clean"]) / runs["clean"].train_s
    return {
        "survivors_kept": survivors_kept(runs["faulted"]),
        "pace_without_heal": plain,
        "heal_pace_ratio": heal / plain,  # the fault-free --heal run's steps per second / without --heal
    }


def tables(args: RecoveryArgs, results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        f"\nRecovery under --heal at {args.nproc} processes, a random worker SIGKILLed every {args.every:g} s of "
        f"training, {args.faults or 'until it ends'} a run{' ' + args.extra if args.extra else ''}"
        f"{', cold replacements' if args.cold else ''}; seconds from the kill, median [min-max] over every fault of "
        f"{args.repeats} run(s) each",
        "",
        "| experiment | " + " | ".join(name for name, _ in PHASES) + " (= the survivors' loss) | steps abandoned |",
        "|---" * (len(PHASES) + 2) + "|",
    ]
    for experiment, rows in results.items():
        faults = [fault for row in rows for fault in row["faults"]]
        cells = [spread([f["phases"].get(name) for f in faults]) for name, _ in PHASES]
        lines.append(f"| {experiment} | {' | '.join(cells)} | {spread([f['abandoned'] for f in faults], '{:.0f}')} |")
    lines += [
        "",
        "| experiment | faults | a fault every (s of training) | lost per fault (s) | goodput | goodput by phase | "
        "bitwise | survivors kept their processes | fault-free steps/s, --heal / without | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for experiment, rows in results.items():
        lines.append(
            f"| {experiment} | {sum(len(row['faults']) for row in rows)} | "
            f"{spread([row['fault_every_s'] for row in rows], '{:.1f}')} | "
            f"{spread([row['lost_per_fault_s'] for row in rows])} | "
            f"{spread([100 * row['goodput'] for row in rows], '{:.1f}')}% | "
            f"{spread([100 * row['goodput_by_phase'] for row in rows], '{:.1f}')}% | "
            f"{sum(row['bitwise'] for row in rows)} of {len(rows)} | "
            f"{sum(row['survivors_kept'] for row in rows)} of {len(rows)} | "
            f"{spread([row['pace'] for row in rows], '{:.1f}')} / "
            f"{spread([row['pace_without_heal'] for row in rows], '{:.1f}')} | "
            f"{spread([row['heal_pace_ratio'] for row in rows])} |"
        )
    return "\n".join(lines)
