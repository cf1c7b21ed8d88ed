"""Preflight: check a whole (multi-node) job before the real run, and print one table on global rank 0.

Launch it exactly like the run it prepares (same nodes, processes, environment), e.g.:

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.preflight
    make train EXPERIMENT=preflight ARGS="--dataset cifar10 --json runs/preflight.json"
    # two nodes: the same command on each, only --node-rank differs
    python -m ddp_core.torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 --master-addr=NODE0 -m experiments.preflight
    # Docker: EXPERIMENT=preflight in each host's .env (or environment), then compose as for training
    EXPERIMENT=preflight docker compose -f docker-compose.yml -f docker/compose.multihost.yml up trainer

The tool lives in tools/preflight/ (``python -m tools.preflight`` runs it too); ``experiments.preflight``, the
name above, EXPERIMENT=preflight and the docs use, is an alias of it.

One row per check, a column per node (the worst status among its ranks): PASS, WARN, FAIL or SKIP, then
one line per FAIL saying how to fix it. Exit 0 when nothing FAILs (WARN is fine), else 4
(PREFLIGHT_FAILED_EXIT_CODE). ``--json PATH`` writes the same rows (rank 0).

The checks (tools/preflight/: probes.py collects, verdicts.py judges, nccl_log.py reads NCCL's log, table.py prints):
- versions: python, torch, CUDA and NCCL the same on every rank;
- code: the same ddp-lab code on every rank: one digest of ddp_core/, experiments/, tools/ and requirements.txt
  compared first; only when they differ are the per-file digests gathered, so the edited file is named;
- environment: every NCCL_*, SEED, DETERMINISTIC, BACKEND, DIST_TIMEOUT_S, DIST_INIT_TIMEOUT_S equal everywhere;
- network (several nodes): the interface each node's backend uses (ddp_core.distributed.network: yours, or
  the one with the route to MASTER_ADDR) and that every node reaches every other on it, probed before the
  process group forms; a FAIL there stops the preflight at once, with that row only;
- GPUs (SKIP without CUDA): one device per local rank, the compute capability in this torch's arch
  list, the driver new enough for torch's CUDA, no memory held by another process;
- host (each node's local rank 0): /dev/shm size, write access and free space at --run-dir and
  --data-dir (a temp file created and removed), --dataset present and verified; memlock and InfiniBand
  devices only when asked for (--expect-ib or NCCL_IB_DISABLE=0);
- clock skew: rank 0 and each other node's local rank 0 exchange timestamps with send/recv (five
  round trips, the shortest kept); the offset is the remote time minus the round trip's midpoint;
- all_reduce: rank-unique int64 values whose sum has a closed form, checked on every rank;
- bandwidth: send/recv ping-pong between each pair of nodes' local ranks 0 in turn (within one node:
  ranks 0 and 1), so a slow link is named;
- transport: gloo is TCP; on NCCL, parsed from NCCL's own INFO log: your NCCL_DEBUG_FILE when you set one
  with NCCL_DEBUG=INFO, else a file of preflight's (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET for this
  run only; the lines your own NCCL_DEBUG level asked for are printed afterwards).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ddp_core.config import CommonArgs, option, require
from ddp_core.distributed import network
from ddp_core.distributed.collectives import all_gather_object, broadcast_object, gather_object
from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.group import DistContext, process_group
from ddp_core.distributed.network import NetworkChoice
from ddp_core.errors import RunStoppedError
from ddp_core.exit_codes import PREFLIGHT_FAILED_EXIT_CODE
from ddp_core.process.entry import entry_main
from ddp_core.ranks import on_rank0
from tools.preflight import probes, reach, verdicts
from tools.preflight.nccl_log import NcclLogPlan, enable_nccl_log, read_nccl_log
from tools.preflight.table import render_table, report, write_json

DATASETS = ("none", "cifar10")


@dataclass
class PreflightArgs(CommonArgs):
    # Not path-checked at parsing (CommonArgs's is): an unwritable run directory is a row of the table.
    run_dir: str = option(
        "",
        "the directory the real run will write into (default runs/): write access and free space are checked",
        env="RUN_DIR",
    )
    data_dir: str = option("data", "folder holding the dataset (cifar-10-batches-py/ for CIFAR10)", env="DATA_DIR")
    dataset: str = option("none", "the dataset to look for under --data-dir and check", choices=DATASETS)
    verify: bool = option(
        True, "check the official md5 sums of the dataset (--no-verify for another dataset in the same format)"
    )
    expect_ib: bool = option(
        False,
        "the job must use InfiniBand/RoCE: check memlock, the adapters and NCCL's transport "
        "(also on with NCCL_IB_DISABLE=0)",
    )
    json: str = option("", "also write the result as JSON to this file (rank 0)")
    min_shm_gib: float = option(1.0, "WARN when /dev/shm is smaller than this many GiB", minimum=0, maximum=1 << 20)
    min_free_gib: float = option(
        1.0, "FAIL when the run directory has less free space than this many GiB", minimum=0, maximum=1 << 30
    )
    clock_warn_s: float = option(
        1.0, "WARN when a node's clock is off rank 0's by more than this many seconds", above=0, maximum=1e9
    )
    clock_fail_s: float = option(
        60.0, "FAIL when a node's clock is off rank 0's by more than this many seconds", above=0, maximum=1e9
    )
    bandwidth_mib: int = option(
        0, "MiB sent each way per transfer between two nodes (0: 64 on CUDA, 4 on CPU)", minimum=0, maximum=1 << 14
    )
    bandwidth_reps: int = option(3, "timed round trips per pair of nodes (after one warm-up)", minimum=1, maximum=1000)
    slow_link_fraction: float = option(
        0.5, "WARN for a link slower than this fraction of the median link", minimum=0, maximum=1
    )
    min_bandwidth_gbps: float = option(
        0.0, "FAIL for a link slower than this many GB/s (0: off)", minimum=0, maximum=1e6
    )
    gpu_foreign_mib: int = option(
        2048,
        "WARN when more than this many MiB of a GPU are in use beyond the rank's own allocations "
        "(its CUDA context and NCCL's buffers count here)",
        minimum=0,
        maximum=1 << 30,
    )


class PreflightFailed(RunStoppedError):
    exit_code = PREFLIGHT_FAILED_EXIT_CODE


def validate(args: PreflightArgs) -> None:
    require(
        args.clock_warn_s <= args.clock_fail_s,
        f"--clock-warn-s={args.clock_warn_s:g} is above --clock-fail-s={args.clock_fail_s:g}: "
        "the warning threshold must be the lower one",
    )


def run_checks(
    args: PreflightArgs,
    ctx: DistContext,
    environ: dict[str, str],
    nccl_log: NcclLogPlan | None,
    reach: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """Every rank: collect, gather, measure. Rank 0: the verdicts, the table, the JSON; returns the report."""
    node = network.node_of(ctx.env, os.environ)
    mine, digests = probes.rank_facts(args, ctx.rank, ctx.env.local_rank, node, environ, ctx.device.type)
    facts = all_gather_object(mine)
    file_maps = _differing_files(ctx.rank, facts, mine, digests)
    measured = _measure(args, ctx, facts, node, nccl_log)
    if measured is None:
        return None
    rows = _verdicts(args, ctx, facts, file_maps, reach, measured, nccl_log)
    failed = any(v.status == verdicts.FAIL for v in rows)
    code = PREFLIGHT_FAILED_EXIT_CODE if failed else 0
    title = (
        f"preflight: {len(verdicts.nodes_of(facts))} node(s), {ctx.world_size} rank(s), "
        f"{ctx.backend} on {ctx.device.type}"
    )
    print(render_table(rows, facts, title), flush=True)
    document = report(rows, facts, ctx.backend, ctx.device.type, code)
    if args.json and not write_json(args.json, document):
        document["json_error"] = f"--json {args.json} could not be written"
    return document


def _differing_files(
    rank: int, facts: list[dict[str, Any]], mine: dict[str, Any], digests: Any
) -> dict[int, Any] | None:
    """Collective where the code differs: one digest per rank first, the per-file lists only from ranks whose
    digest differs from rank 0's (on rank 0; None elsewhere, and where the code is the same)."""
    if len({f["code"]["digest"] for f in facts}) == 1:
        return None
    send = digests if rank == 0 or mine["code"]["digest"] != facts[0]["code"]["digest"] else None
    gathered = gather_object(send)
    return {rank: m for rank, m in enumerate(gathered) if m is not None} if gathered is not None else None


def _measure(
    args: PreflightArgs, ctx: DistContext, facts: list[dict[str, Any]], node: int, nccl_log: NcclLogPlan | None
) -> dict[str, Any] | None:
    """Collective: the clocks, an all-reduce and the links between nodes; rank 0 gets every rank's, others None."""
    leaders = verdicts.leaders(facts)
    offsets = probes.measure_clocks(ctx, leaders) if len(leaders) > 1 else {}
    correct, reduce_s = probes.measure_all_reduce(ctx)
    nbytes = (args.bandwidth_mib or (64 if ctx.device.type == "cuda" else 4)) * verdicts.MIB
    links = probes.measure_bandwidth(ctx, leaders, nbytes, args.bandwidth_reps)
    transport = read_nccl_log(nccl_log) if ctx.backend == "nccl" else None
    ranks = gather_object(
        {"rank": ctx.rank, "node": node, "all_reduce_ok": correct, "links": links, "transport": transport}
    )
    if ranks is None:
        return None
    return {"leaders": leaders, "offsets": offsets, "reduce_s": reduce_s, "nbytes": nbytes, "ranks": ranks}


def _verdicts(
    args: PreflightArgs,
    ctx: DistContext,
    facts: list[dict[str, Any]],
    file_maps: dict[int, Any] | None,
    reach: list[dict[str, Any]],
    measured: dict[str, Any],
    nccl_log: NcclLogPlan | None,
) -> list[verdicts.Verdict]:
    """Rank 0: one row per check, in the table's order."""
    rank0_node, ranks, nbytes = facts[0]["node"], measured["ranks"], measured["nbytes"]
    transports = {m["node"]: m["transport"] for m in ranks if m["rank"] == measured["leaders"][m["node"]]}
    return [
        verdicts.check_versions(facts),
        verdicts.check_code(facts, file_maps),
        verdicts.check_environment(facts),
        verdicts.check_network(reach, list(verdicts.nodes_of(facts))),
        verdicts.check_gpu_devices(facts),
        verdicts.check_gpu_capability(facts),
        verdicts.check_gpu_driver(facts),
        verdicts.check_gpu_memory(facts, args.gpu_foreign_mib * verdicts.MIB),
        verdicts.check_shm(facts, int(args.min_shm_gib * verdicts.GIB)),
        verdicts.check_directory(facts, "run_dir", "run_dir", int(args.min_free_gib * verdicts.GIB), rank0_node),
        verdicts.check_directory(facts, "data_dir", "data_dir", 0, rank0_node),
        verdicts.check_dataset(facts),
        verdicts.check_memlock(facts),
        verdicts.check_infiniband(facts),
        verdicts.check_clocks(facts, measured["offsets"], args.clock_warn_s, args.clock_fail_s),
        verdicts.check_all_reduce(
            facts, {m["rank"]: m["all_reduce_ok"] for m in ranks}, measured["reduce_s"], probes.REDUCE_NUMEL * 8
        ),
        verdicts.check_bandwidth(
            facts,
            [link for m in ranks for link in m["links"]],
            args.slow_link_fraction,
            args.min_bandwidth_gbps,
            f"{nbytes / verdicts.MIB:g} MiB ping-pong x{args.bandwidth_reps}",
        ),
        verdicts.check_transport(
            facts, ctx.backend, transports, f"NCCL's log ({nccl_log.path if nccl_log else 'none'}) named no transport"
        ),
    ]


class NetworkProbe:
    """process_group's ``before_init``: the nodes reach each other on the interfaces chosen for the backend.

    It runs before the group forms, because a group cannot form across nodes that do not reach each other
    (it would wait out DIST_TIMEOUT_S): a FAIL here prints the table's network row and stops every rank.
    """

    def __init__(self, args: PreflightArgs):
        self.args = args
        self.reports: list[dict[str, Any]] = []

    def __call__(self, store: Any, env: DistEnv, choice: NetworkChoice | None, problem: str | None) -> None:
        if env.num_nodes <= 1:
            return
        node = network.node_of(env, os.environ)
        self.reports = [
            asdict(r) for r in reach.probe_reachability(store, env, node, choice, problem, self.args.dist_timeout_s)
        ]
        verdict = verdicts.check_network(self.reports, range(env.num_nodes))
        if verdict.status != verdicts.FAIL:
            return
        on_rank0(lambda: self.say_it_failed(verdict, env))
        raise PreflightFailed("preflight: 1 check(s) failed (network): the table above says how to fix it")

    def say_it_failed(self, verdict: verdicts.Verdict, env: DistEnv) -> None:
        """Rank 0: the table's network row, and the JSON report if asked for."""
        host = {r["node"]: r["host"] for r in self.reports}
        facts = [
            {"rank": r, "node": r // env.local_world_size, "host": host[r // env.local_world_size]}
            for r in range(env.world_size)
        ]
        title = (
            f"preflight: {env.num_nodes} node(s), {env.world_size} rank(s): stopped before the process group, "
            "which cannot form while the nodes do not reach each other"
        )
        print(render_table([verdict], facts, title), flush=True)
        if self.args.json:
            write_json(self.args.json, report([verdict], facts, "", "", PREFLIGHT_FAILED_EXIT_CODE))


def preflight(args: PreflightArgs) -> dict[str, Any] | None:
    environ = dict(os.environ)  # what the user set (and .env), before NCCL's log is switched on below
    nccl_log = enable_nccl_log() if torch.cuda.is_available() and args.backend in ("auto", "nccl") else None
    probe = NetworkProbe(args)
    with process_group(args.dist_config(), before_init=probe) as ctx:
        document = run_checks(args, ctx, environ, nccl_log, probe.reports)
        failed = broadcast_object(
            (
                [c["name"] for c in document["checks"] if c["status"] == verdicts.FAIL]
                + (["--json"] if "json_error" in document else [])
            )
            if document
            else None
        )
    if failed:
        raise PreflightFailed(
            f"preflight: {len(failed)} check(s) failed ({', '.join(failed)}): the table above says how to fix each"
        )
    return document


main = entry_main(PreflightArgs, preflight, doc=__doc__, validate=validate)
