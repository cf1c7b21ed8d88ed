"""What a failure costs: `python -m bench.recovery` (`make recovery`; minutes, not in `make bench`).

For each experiment (the toy; CIFAR10 ``--model small`` on a generated stand-in), ``--repeats`` pairs of runs at
``--nproc`` processes under ``python -m ddp_core.torchrun --max-restarts``, alternating: one with a random worker
SIGKILLed every ``--every`` seconds of training (``--faults`` times), one without. Every process of a run notes
its phases in a timeline (``DDP_LAB_TIMELINE``, ddp_core/process/timeline.py): the launcher when it saw the
failure, stopped the others and started new workers; each worker when its imports were done, its process group
formed, its checkpoint loaded and its first step taken. The step each fault cost is read from the victim's
heartbeat (ddp_core/process/heartbeat.py) just before the kill.

Per fault: detection (kill to the launcher closing the other workers), teardown of the survivors, the launcher's own
restart (its rendezvous), start (interpreters up, torch imported), process group, set-up (run directory, model,
data), checkpoint load, settling and the first step (a resume's replayed step included), and the steps lost (trained
after the checkpoint, trained again), in steps and in seconds at the fault-free run's pace. Per run pair: the
seconds lost per fault ((faulted - fault-free training time) / faults), goodput (useful steps per second with faults
/ without, over the training time: first step to the launcher's exit), goodput by phase (1 - the faults' lost
seconds by the breakdown / the faulted run's training time: what the faults cost, whatever the machine's pace did
between the two runs), the fault rate the faulted run had (its
training seconds per fault; with ``--faults 0`` a fault comes every ``--every`` seconds until the run ends, so the
rate is the one asked whatever the machine's pace; otherwise size ``--toy-steps`` so that the run lasts about
``--faults`` x ``--every``, or the rate is lower than asked), the fault-free run's steps per second, and whether
the faulted run's final weights equal the fault-free run's, bitwise. Medians with [min-max]; ``--json`` prints
every figure. ``--heal``: the launcher replaces only the killed worker (what is timed then: bench/recovery_heal.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench import recovery_heal
from bench import timeline as worker_timeline
from bench.processes import child_env, stop_group
from bench.recovery_runs import Fault, Job, RecoveryArgs, spread, steps_of, training, workers
from ddp_core.layout import CHECKPOINTS, LAST
from ddp_core.process import timeline, warm
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]
UNLIMITED_RESTARTS = 1000  # --faults 0: torchrun's --max-restarts, more than any run here has faults
EXPERIMENTS = ("toy", "cifar10")
# the columns of the per-fault breakdown, each the time between two events (ddp_core/process/timeline.py)
PHASES = (
    ("detection", "kill", "closing"),
    ("teardown", "closing", "stopped"),
    ("launcher restart", "stopped", "spawned"),
    ("start + import torch", "spawned", "imported"),
    ("process group", "imported", "group"),
    ("set-up", "group", "loading"),
    ("checkpoint load", "loading", "loaded"),
    ("settling + first step", "loaded", "first_step"),
)


def command(args: RecoveryArgs, experiment: str, run_dir: Path, data: Path | None, heal: bool = False) -> list[str]:
    restarts = [
        f"--max-restarts={args.faults + 1 if args.faults else UNLIMITED_RESTARTS}",
        *(["--heal"] if heal else []),
    ]
    launch = [sys.executable, "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={args.nproc}", *restarts]
    flags = ["--run-dir", str(run_dir), "--checkpoint-every", str(args.checkpoint_every), *args.extra.split()]
    if experiment == "toy":
        flags += ["--steps", str(args.toy_steps), "--dataset-size", "512", "--log-every", "500"]
    else:
        flags += ["--model", "small", "--epochs", str(args.cifar10_epochs), "--data-dir", str(data), "--no-verify"]
        flags += ["--batch-size", "64", "--log-every", "50"]
    return [*launch, "-m", f"experiments.{experiment}", *flags]


def step_reached(job_dir: str, rank: int) -> int | None:
    """The step ``rank`` had reached, from its heartbeat (ddp_core/process/heartbeat.py)."""
    try:
        return int(Path(job_dir, f"rank_{rank}").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def scene(
    events: list[dict[str, Any]], kills: list[Fault], nproc: int
) -> tuple[float | None, dict[int, int], str | None]:
    """When the group trained again after the last kill (None: not yet), each rank's worker and the heartbeat
    folder."""
    return (training(events, len(kills), nproc), *workers(events, len(kills)))


def run_job(args: RecoveryArgs, cmd: list[str], run_dir: Path, faults: int | None, rng: random.Random) -> Job:
    """One run; ``faults`` kills (None: as many as fit), the first ``--every`` seconds after its first step, each
    later one ``--every`` seconds after the one before and never before the group trains again."""
    path = run_dir.parent / f"{run_dir.name}.timeline"
    env = child_env(OMP_NUM_THREADS="1", **worker_timeline.env(str(path)), **{warm.VARIABLE: "0" if args.cold else "1"})
    kills: list[Fault] = []
    started = time.time()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        agent = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while agent.poll() is None:
                if time.time() - started > args.timeout:
                    stop_group(agent, 10)
                    break
                time.sleep(0.05)  # polling the run: a kill is due at a time, not at an event
                if faults is not None and len(kills) >= faults:
                    continue
                if (fault := strike(args, timeline.read(path), kills, rng)) is not None:
                    kills.append(fault)
        finally:
            if agent.poll() is None:
                stop_group(agent, 10)
    ended = time.time()
    events = timeline.read(path)
    first = training(events, 0, args.nproc)
    if args.heal:
        recovery_heal.measure_faults(kills, events)
    else:
        for number, fault in enumerate(kills, start=1):
            closing = [e for e in events if e["event"] == "closing" and e["t"] >= fault.kill][:1]
            measure_fault(fault, [e for e in events if e["restart"] == number and e["event"] != "closing"] + closing)
    return Job(agent.returncode, ended - started, ended - first if first else float("nan"), kills, run_dir, events)


def strike(args: RecoveryArgs, events: list[dict[str, Any]], kills: list[Fault], rng: random.Random) -> Fault | None:
    """A random rank's worker SIGKILLed where a kill is due: ``--every`` seconds after the group trained again."""
    if args.heal:
        up, pids, job_dir = recovery_heal.scene(events, kills, args.nproc)
    else:
        up, pids, job_dir = scene(events, kills, args.nproc)
    if up is None or time.time() < max(up, kills[-1].kill if kills else up) + args.every:
        return None
    rank = rng.choice(sorted(pids))
    step = step_reached(job_dir, rank) if job_dir else None
    if step is None:
        return None
    os.kill(pids[rank], signal.SIGKILL)
    return Fault(kill=time.time(), rank=rank, step=step, pid=pids[rank])


def measure_fault(fault: Fault, events: list[dict[str, Any]]) -> None:
    """The phases of the restart that followed ``fault``: each the latest of its event over the processes (the
    slowest rank holds the others back), from the end of the phase before."""
    at: dict[str, float] = {"kill": fault.kill}
    for name in ("closing", "stopped", "spawned", "imported", "group", "loading", "loaded", "first_step"):
        times = [e["t"] for e in events if e["event"] == name]
        if times:
            at[name] = max(times)
    loaded = [e.get("step") for e in events if e["event"] == "loaded"]
    fault.resumed_at = loaded[0] if loaded else 0  # no checkpoint yet: the run started over
    fault.steps_lost = fault.step - fault.resumed_at
    for name, begin, end in PHASES:
        if begin in at and end in at:
            fault.phases[name] = at[end] - at[begin]
    if "first_step" in at:
        fault.lost_s = at["first_step"] - fault.kill


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / CHECKPOINTS / LAST, map_location="cpu", weights_only=True)
    model = checkpoint.get("model")
    if not isinstance(model, dict):  # a checkpoint of named states: the model's among them
        model = next(v["model"] for v in checkpoint.values() if isinstance(v, dict) and "model" in v)
    return model


def same_weights(a: Path, b: Path) -> bool:
    try:
        first, second = final_weights(a), final_weights(b)
    except (OSError, RuntimeError, StopIteration, KeyError):
        return False
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def measure(args: RecoveryArgs, report: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(args.seed)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as folder:
        data = None
        for experiment in [name.strip() for name in args.experiments.split(",") if name.strip()]:
            if experiment not in EXPERIMENTS:
                raise SystemExit(f"error: --experiments: {experiment!r} is none of {', '.join(EXPERIMENTS)}")
            if experiment == "cifar10" and data is None:
                from experiments.cifar10_data import write_standin

                data = Path(folder) / "data"  # the stand-in's cifar-10-batches-py/ goes in it
                write_standin(data, train_images=args.cifar10_images, test_images=1000)
            results[experiment] = []
            for repeat in range(args.repeats):
                # under --heal a third run, without it and fault-free, beside --heal's: what its quorums cost a step
                kinds = ("faulted", "clean", "plain") if args.heal else ("faulted", "clean")
                pair: dict[str, Job] = {}
                for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                    run_dir = Path(folder) / f"{experiment}-{repeat}-{kind}"
                    cmd = command(args, experiment, run_dir, data, heal=args.heal and kind != "plain")
                    faults = (args.faults or None) if kind == "faulted" else 0
                    pair[kind] = run_job(args, cmd, run_dir, faults, rng)
                    job = pair[kind]
                    if job.returncode != 0:
                        tail = (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
                        raise SystemExit(f"error: {experiment} {kind} run exited {job.returncode}:\n{tail}")
                results[experiment].append(summarise(pair["faulted"], pair["clean"]))
                row = results[experiment][-1]
                if args.heal:
                    row.update(recovery_heal.summarise(pair))
                report(
                    f"{experiment} pair {repeat + 1}/{args.repeats}: {len(row['faults'])} faults, "
                    f"{row['lost_per_fault_s']:.1f} s lost per fault, goodput {row['goodput']:.1%}, "
                    f"bitwise {row['bitwise']}"
                    + (f", survivors kept their processes {row['survivors_kept']}" if args.heal else "")
                )
    return results


def summarise(faulted: Job, clean: Job) -> dict[str, Any]:
    steps = steps_of(clean)
    pace = steps / clean.train_s  # steps per second without faults
    for fault in faulted.faults:
        if fault.lost_s is not None and fault.steps_lost is not None:
            fault.lost_s += fault.steps_lost / pace
    count = max(len(faulted.faults), 1)
    # The faults' own cost, as the breakdown timed it: immune to the machine's pace moving between the two runs
    # (on this VM a whole run's pace moves by 10-20%, as much as a minute's fault costs).
    lost = sum(fault.lost_s for fault in faulted.faults if fault.lost_s is not None)
    return {
        "faults": [asdict(fault) for fault in faulted.faults],
        "train_s": {"faulted": faulted.train_s, "clean": clean.train_s},
        "wall_s": {"faulted": faulted.wall_s, "clean": clean.wall_s},
        "steps": steps,
        "lost_per_fault_s": (faulted.train_s - clean.train_s) / count,
        "fault_every_s": faulted.train_s / count,  # the fault rate the run had: its training time per fault
        "pace": pace,
        "goodput": clean.train_s / faulted.train_s,
        "goodput_by_phase": 1 - lost / faulted.train_s,
        "bitwise": same_weights(faulted.run_dir, clean.run_dir),
    }


def tables(args: RecoveryArgs, results: dict[str, list[dict[str, Any]]]) -> str:
    if args.heal:
        return recovery_heal.tables(args, results)
    lines = [
        f"\nRecovery at {args.nproc} processes, a random worker SIGKILLed every {args.every:g} s of training, "
        f"{args.faults or 'until it ends'} a run, --checkpoint-every {args.checkpoint_every}"
        f"{' ' + args.extra if args.extra else ''}{', cold restarts' if args.cold else ''}"
        "; "
        f"median [min-max] over every fault of {args.repeats} run(s) each",
        "",
        "| experiment | " + " | ".join(name for name, _, _ in PHASES) + " | steps lost | lost per fault (s) |",
        "|---" * (len(PHASES) + 3) + "|",
    ]
    for experiment, rows in results.items():
        faults = [fault for row in rows for fault in row["faults"]]
        cells = [spread([f["phases"].get(name) for f in faults]) for name, _, _ in PHASES]
        lost = spread([f["steps_lost"] for f in faults], "{:.0f}")
        lines.append(f"| {experiment} | {' | '.join(cells)} | {lost} | {spread([f['lost_s'] for f in faults])} |")
    lines += [
        "",
        "| experiment | faults | training s (faulted, fault-free) | a fault every (s of training) | "
        "fault-free steps/s | lost per fault (s) | goodput | goodput by phase | bitwise |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for experiment, rows in results.items():
        lines.append(
            f"| {experiment} | {sum(len(row['faults']) for row in rows)} | "
            f"{spread([row['train_s']['faulted'] for row in rows], '{:.1f}')}, "
            f"{spread([row['train_s']['clean'] for row in rows], '{:.1f}')} | "
            f"{spread([row['fault_every_s'] for row in rows], '{:.1f}')} | "
            f"{spread([row['pace'] for row in rows], '{:.1f}')} | "
            f"{spread([row['lost_per_fault_s'] for row in rows])} | "
            f"{spread([100 * row['goodput'] for row in rows], '{:.1f}')}% | "
            f"{spread([100 * row['goodput_by_phase'] for row in rows], '{:.1f}')}% | "
            f"{sum(row['bitwise'] for row in rows)} of {len(rows)} |"
        )
    return "\n".join(lines)


def run_bench(args: RecoveryArgs) -> dict[str, list[dict[str, Any]]]:
    report = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    results = measure(args, report)
    if args.json:
        print(json.dumps({"args": asdict(args), "results": results}, indent=1, default=str))
    else:
        print(tables(args, results))
    if not all(row["bitwise"] and row.get("survivors_kept", True) for rows in results.values() for row in rows):
        raise SystemExit(1)
    return results


main = command_main(RecoveryArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
