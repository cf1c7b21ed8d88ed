"""Can torchft heal a killed replica while the survivors keep training, bitwise? A spike, measured on the toy.

    pip install -r requirements-heal.txt        # torchft-nightly 2026.10.26: an optional extra (docs/decisions.md)
    python -m bench.heal_trial                   # 2 replicas, 1000 steps, replica 1 SIGKILLed at steps 300 and 650
    python -m bench.heal_trial --replicas 3 --kills 250,600 --steps 900
    python -m bench.heal_trial --loop planned    # the step as --heal would drive it: see planned_step
    python -m bench.heal_trial --loop planned --spare   # the replacement a spare that had imported and set up
    python -m bench.heal_trial --quorum 1        # the control: the survivor trains alone, the weights differ

torchft's lighthouse runs in this process (``LighthouseServer``, ``min_replicas`` = ``--replicas``: no step
commits with a replica missing). Each replica is one plain process, its own replica group of one (its own
TCPStore), training experiments/toy.py's network with torchft's ``Manager`` (synchronous quorum),
``DistributedDataParallel`` and ``Optimizer`` over torchft's reconfigurable gloo group. Each replica's batch at
step s is drawn from (seed, replica, s), so a retried step trains on the same samples. The victim (``--victim``) is
SIGKILLed from here ``--kill-delay-ms`` after its printed step reaches each of ``--kills`` (so that the kill lands
inside a step) and started again at once, or replaced by a spare (``--spare``): the spike's stand-in for the
launcher. The replacement receives model and optimizer (SGD with momentum) from a live peer over torchft's HTTP
transport. A replica whose collective failed aborts its group at once (``--no-abort``: not; a survivor waiting on
another survivor then waits out the 30 s timeout). A fault-free run with the same seed runs first.

Printed: per fault, the survivors' wait (their longest pause between two committed steps after the kill, against
the median step); the last replacement's phases from its spawn (imports done; set-up done: model, optimizer,
torchft's manager; healed: quorum and state received; first commit); the steps abandoned and retried; whether every
survivor kept its process; whether every replica's final weights (and, ``--loop planned``, the survivors' logged
losses) equal the fault-free run's, bitwise. Exit status 1 when a survivor was restarted or anything differs. (A
first optimizer's construction imports torch._dynamo and sympy: about 1 s of the set-up on this machine.) Against
a plain torch DDP run of the same batches: bitwise at 2 replicas; at 3, 1-2e-7 apart (likely the sum's order).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ddp_core.training.seed import seed_rank_streams
from experiments.toy import ToyModel, make_dataset

REPO = Path(__file__).resolve().parents[1]
DATASET = 4096
BATCH = 32


def batch(seed: int, replica: int, step: int, data: torch.utils.data.TensorDataset) -> list[torch.Tensor]:
    """The samples replica ``replica`` trains on at ``step``: the same on a retry and in a replacement."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + replica * 100_003 + step)
    return data[torch.randint(0, DATASET, (BATCH,), generator=generator)]


def replica_main(args: argparse.Namespace) -> None:
    """One replica group of one process: trains until the quorum's step reaches --steps, then writes its result."""
    started = time.time()
    torch.set_num_threads(1)
    import torchft  # optional: imported here so that importing this module needs no torchft

    imported = time.time()
    torch.manual_seed(args.seed)
    model = ToyModel()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: optimizer state must travel
    if args.spare:  # imported and set up ahead of the fault: wait for the word to replace the dead replica
        print("ready", flush=True)
        sys.stdin.readline()
        started = imported = time.time()
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = make_manager(args, model, inner, pg)
    ready = time.time()
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.Optimizer(manager, inner)
    data = make_dataset(DATASET, args.seed)
    commits: list[float] = []
    logs: dict[int, float] = {}  # the planned loop's log points: the loss averaged over the replicas
    healed, abandoned = None, 0
    while manager.current_step() < args.steps:
        if args.loop == "planned":
            step, committed = planned_step(args, manager, pg, ddp, inner, data, logs)
        else:
            optimizer.zero_grad()  # the quorum; a replacement receives the state here
            step = manager.current_step()
            inputs, targets = batch(args.seed, args.replica, step, data)
            torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
            abort_if_failed(args, manager, pg)
            optimizer.step()  # steps only when every replica's allreduce succeeded
            committed = manager.current_step() > step
        healed = healed or time.time()
        abandoned += not committed
        if committed:
            commits.append(time.time())
            if step % 10 == 0:
                print(f"step {step}", flush=True)
    manager.shutdown(wait=False)
    out = Path(args.out)
    torch.save(model.state_dict(), out / f"replica{args.replica}.pt")
    times = {"started": started, "imported": imported, "ready": ready, "healed": healed, "commits": commits}
    (out / f"replica{args.replica}.json").write_text(
        json.dumps({"pid": os.getpid(), "logs": logs, "abandoned": abandoned, **times})
    )


def make_manager(args: argparse.Namespace, model: torch.nn.Module, inner: torch.optim.Optimizer, pg: Any) -> Any:
    """torchft's manager for this replica: its own TCPStore, the quorum of every replica, a synchronous quorum."""
    import torchft

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    return torchft.Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=state,
        min_replica_size=args.quorum or args.replicas,
        use_async_quorum=False,  # heal before the forward pass: every committed step has every replica
        init_sync=False,  # every replica starts from the same seed
        replica_id=f"replica{args.replica}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )


def planned_step(
    args: argparse.Namespace, manager: Any, pg: Any, ddp: Any, inner: Any, data: Any, logs: dict[int, float]
) -> tuple[int, bool]:
    """The step as ddp-lab's loop would drive it under --heal: the quorum at its start (a replacement heals here);
    this replica's random streams re-seeded from (seed, replica, step) and drawn from (input noise: a per-rank
    stream no peer could send); two micro-batches, the first under ``no_sync`` (--grad-accum 2); every 10th step a
    log point whose all-reduce is part of the step; the commit decided before the optimizer's step. An abandoned
    step leaves nothing behind and is retried on the same batches, draws and log point."""
    manager.start_quorum()
    step = manager.current_step()
    seed_rank_streams(args.seed, args.replica, step)
    inner.zero_grad(set_to_none=True)
    losses = []
    for micro in range(2):
        inputs, targets = batch(args.seed, args.replica, 2 * step + micro, data)
        inputs = inputs + 0.01 * torch.randn_like(inputs)
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(ddp(inputs), targets) / 2
            loss.backward()
        losses.append(loss.detach())
    logged = torch.stack(losses).sum() if step % 10 == 0 else None
    if logged is not None:
        manager.allreduce(logged).wait()  # averaged over the replicas; a failure makes should_commit say no
    abort_if_failed(args, manager, pg)
    if not manager.should_commit():
        return step, False
    inner.step()
    if logged is not None:
        logs[step] = logged.item()
    return step, True


def abort_if_failed(args: argparse.Namespace, manager: Any, pg: Any) -> None:
    """A peer died in one of this step's collectives: close this replica's connections at once. Without it, a
    survivor waiting on data from this one (not from the dead peer) waits out the group's timeout (30 s here)."""
    if manager.errored() is not None and not args.no_abort:
        pg.abort()


def start(args: argparse.Namespace, replica: int, lighthouse: str, out: Path, spare: bool = False) -> subprocess.Popen:
    command = [sys.executable, "-m", "bench.heal_trial", "--replica", str(replica), "--lighthouse", lighthouse]
    command += ["--out", str(out), "--steps", str(args.steps), "--replicas", str(args.replicas)]
    command += ["--seed", str(args.seed), "--loop", args.loop, "--quorum", str(args.quorum)]
    command += ["--spare"] if spare else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out / f"replica{replica}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        stdin = subprocess.PIPE if spare else None
        return subprocess.Popen(command, cwd=REPO, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=log, text=True)


def ready(spare: subprocess.Popen) -> subprocess.Popen:
    """``spare`` once it has imported and set up (its line "ready")."""
    if spare.stdout.readline().strip() != "ready":
        raise SystemExit("a spare ended before it was ready: see its log")
    return spare


def run(args: argparse.Namespace, kills: list[int], out: Path) -> dict[str, Any]:
    """One run: the lighthouse, the replicas, the victim killed at each of ``kills`` and started again."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=args.quorum or args.replicas,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        join_timeout_ms=100,
    )
    victim = args.victim % args.replicas
    procs = {r: start(args, r, lighthouse.address(), out) for r in range(args.replicas)}
    first_pids = {r: p.pid for r, p in procs.items()}
    faults: list[dict[str, float]] = []
    pending = list(kills)
    spare = ready(start(args, victim, lighthouse.address(), out, spare=True)) if args.spare and kills else None
    while pending:
        line = procs[victim].stdout.readline()
        if not line:
            raise SystemExit(f"replica {victim} ended before step {pending[0]}: see {out}/replica{victim}.log")
        if line.startswith("step") and int(line.split()[1]) >= pending[0]:
            time.sleep(args.kill_delay_ms / 1000)  # where in the next step the kill lands
            if procs[victim].poll() is not None:
                raise SystemExit(f"replica {victim} finished before its kill at step {pending[0]}: more --steps")
            procs[victim].send_signal(signal.SIGKILL)
            faults.append({"kill": time.time()})
            procs[victim].wait()
            if spare is not None:
                procs[victim], spare = spare, start(args, victim, lighthouse.address(), out, spare=True)
                procs[victim].stdin.write("go\n")
                procs[victim].stdin.flush()
            else:
                procs[victim] = start(args, victim, lighthouse.address(), out)
            faults[-1]["spawned"] = time.time()
            pending.pop(0)
            if spare is not None:
                ready(spare)  # the next spare is ready before the next fault
    if spare is not None:
        spare.kill()
        spare.communicate()
    for proc in procs.values():
        proc.communicate(timeout=args.timeout)  # drains its progress lines, then waits
    codes = {r: p.returncode for r, p in procs.items()}
    lighthouse.shutdown()
    results = {r: json.loads((out / f"replica{r}.json").read_text()) for r in procs}
    weights = {r: torch.load(out / f"replica{r}.pt", weights_only=True) for r in procs}
    return {"codes": codes, "first_pids": first_pids, "faults": faults, "results": results, "weights": weights}


def survivor_wait(commits: list[float], kill: float, until: float) -> float:
    """The survivor's longest gap between two commits from the kill to ``until`` (the next kill): its wait. The
    step in flight at the kill may still commit just after it (the victim had sent its gradients)."""
    times = [t for t in commits if t < until]
    return max((b - max(a, kill) for a, b in zip(times, times[1:]) if b > kill), default=float("nan"))


def report(args: argparse.Namespace, clean: dict[str, Any], faulted: dict[str, Any]) -> bool:
    victim = args.victim % args.replicas
    survivors = [r for r in range(args.replicas) if r != victim]
    results = faulted["results"]
    commits = results[survivors[0]]["commits"]
    step_s = statistics.median(b - a for a, b in zip(commits, commits[1:]))
    print(f"{args.replicas} replicas, {args.steps} steps, median step {step_s * 1000:.1f} ms")
    faults = faulted["faults"]
    for number, fault in enumerate(faults, 1):
        until = faults[number]["kill"] if number < len(faults) else float("inf")
        wait = max(survivor_wait(results[r]["commits"], fault["kill"], until) for r in survivors)
        print(f"fault {number}: survivors' wait {wait:.2f} s (their longest pause between commits after the kill)")
    last = results[victim]
    if faulted["faults"]:
        t0 = faulted["faults"][-1]["spawned"]
        phases = (
            ("imports done", "imported"),
            ("set-up done (model, optimizer, manager)", "ready"),
            ("healed", "healed"),
        )
        print("last replacement, from its spawn: " + ", ".join(f"{n} {last[k] - t0:.2f} s" for n, k in phases))
        print(f"  first commit {last['commits'][0] - t0:.2f} s")
    print(f"steps abandoned and retried, by survivor: {[results[r]['abandoned'] for r in survivors]}")
    kept = all(results[r]["pid"] == faulted["first_pids"][r] for r in survivors)
    codes_ok = all(code == 0 for run_ in (clean, faulted) for code in run_["codes"].values())
    reference = clean["weights"][0]
    bitwise = all(
        torch.equal(w[name], reference[name])
        for run_ in (clean, faulted)
        for w in run_["weights"].values()
        for name in reference
    )
    logs_equal = all(results[r]["logs"] == clean["results"][r]["logs"] for r in survivors)
    if args.loop == "planned":
        print(f"survivors' logged losses equal to the fault-free run's: {'yes' if logs_equal else 'NO'}")
    print(f"survivors kept their process: {'yes' if kept else 'NO'}; every replica exited 0: {codes_ok}")
    print(f"final weights bitwise-equal to the fault-free run's (every replica): {'yes' if bitwise else 'NO'}")
    return kept and bitwise and codes_ok and logs_equal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kills", default="300,650", help="the victim's steps at which it is SIGKILLed")
    parser.add_argument("--kill-delay-ms", type=float, default=3.0, help="from the victim's step line to the kill")
    parser.add_argument("--no-abort", action="store_true", help="no abort after a failed collective")
    parser.add_argument("--keep", help="a folder to keep each replica's log and result in")
    parser.add_argument("--victim", type=int, default=-1, help="the replica killed (default: the last)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--loop",
        choices=("torchft", "planned"),
        default="torchft",
        help="torchft's wrappers, or the step as --heal would drive it (planned_step)",
    )
    parser.add_argument("--quorum", type=int, default=0, help="replicas a step needs (0: all); 1 shows a fault's cost")
    parser.add_argument("--spare", action="store_true", help="replace from a spare started (imports, set-up) ahead")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="the lighthouse's")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)  # a replica's process
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica is not None:
        replica_main(args)
        return 0
    kills = [int(k) for k in args.kills.split(",") if k]
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch)  # --keep: each replica's log and result stay there
        (folder / "clean").mkdir(parents=True, exist_ok=True)
        (folder / "faulted").mkdir(exist_ok=True)
        clean = run(args, [], folder / "clean")
        faulted = run(args, kills, folder / "faulted")
    return 0 if report(args, clean, faulted) else 1


if __name__ == "__main__":
    sys.exit(main())
