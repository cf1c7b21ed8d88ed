"""Collective-communication benchmark like nccl-tests: time, algorithm and bus bandwidth, each result checked.

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.commbench       # every op, default sizes
    python -m ddp_core.torchrun --standalone --nproc-per-node=4 -m experiments.commbench --ops all_reduce,all_gather
    python -m experiments.commbench --nproc 3                                                 # no torchrun

For every op in --ops and every size of the sweep --min-bytes x --factor^k <= --max-bytes: --warmup untimed calls,
a barrier, --iters timed calls; a row's time is the slowest rank's. Each op's size S and bus-bandwidth factor are
nccl-tests's; one more call on rank-unique data with a closed-form result checks it on every rank ("ok" or
"WRONG": any WRONG row makes every rank exit 1, after the table and --json). docs/experiments.md says what S is
for each op and what each check expects.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddp_core.config import CommonArgs, check_values, directory_problem, option, require
from ddp_core.distributed.agreement import rank0_decides
from ddp_core.distributed.collectives import all_gather_object
from ddp_core.distributed.group import DistContext, process_group
from ddp_core.errors import RunStoppedError
from ddp_core.output.logging import print0, setup_logging
from ddp_core.output.run import start_run, write_json_atomic
from ddp_core.process import heartbeat
from ddp_core.process.entry import entry_main
from ddp_core.ranks import on_rank0

log = logging.getLogger("commbench")

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "sendrecv")
CHUNKED_OPS = frozenset({"all_gather", "reduce_scatter", "all_to_all"})  # S is n chunks of S/n
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
KIB, MIB = 1024, 1024**2
DEFAULT_MAX_BYTES_CUDA, DEFAULT_MAX_BYTES_CPU = 64 * MIB, 4 * MIB
MAX_BYTES = 2**36  # 64 GiB: all_to_all holds two buffers of S per rank
UNSUPPORTED_WORDS = ("not supported", "unsupported", "does not support", "not implemented")
OK, WRONG = "ok", "WRONG"
GB = 1e9


# ---------------------------------------------------------------------------------------------- pure parts


def parse_ops(text: str) -> list[str]:
    """``all`` or a comma-separated list of op names -> the ops in the given order, duplicates dropped."""
    if text.strip() == "all":
        return list(OPS)
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise ValueError(", ".join(repr(name) for name in unknown))
    return list(dict.fromkeys(names))


def ops_problem(text: str) -> str | None:
    try:
        parse_ops(text)
    except ValueError as error:
        return f"names an unknown op ({error})"
    return None


def json_path_problem(text: str) -> str | None:
    path = Path(text)
    if path.is_dir():
        return "is a directory"
    folder = path.parent if str(path.parent) else Path(".")  # rank 0, which writes the file, checks it can
    problem = on_rank0(lambda: directory_problem(folder, writable=True)) or directory_problem(folder, writable=False)
    return f"cannot be written: its folder {problem}" if problem else None


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min_bytes``, ``min_bytes*factor``, ... while <= ``max_bytes`` (nccl-tests's -b/-e/-f); max itself
    only if hit."""
    if min_bytes < 1 or factor < 2 or max_bytes < min_bytes:
        raise ValueError(f"no sweep from {min_bytes} to {max_bytes} by {factor}: need 1 <= min <= max and factor >= 2")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def element_count(op: str, size_bytes: int, element_size: int, world: int) -> int:
    """Elements in S: ``size_bytes // element_size``, a multiple of ``world`` for the chunked ops, at least one
    per rank."""
    count = size_bytes // element_size
    if op in CHUNKED_OPS:
        return max(count - count % world, world)
    return max(count, 1)


def bus_factor(op: str, world: int) -> float:
    """nccl-tests's busbw / algbw for ``op`` with ``world`` processes (0 for a chunked op in a world of one)."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in CHUNKED_OPS:
        return (world - 1) / world
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def bandwidths(size_bytes: int, seconds: float, factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for ``size_bytes`` moved in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"time {seconds} s is not positive")
    algbw = size_bytes / seconds / GB
    return algbw, algbw * factor


def input_values(op: str, rank: int, world: int, count: int) -> torch.Tensor:
    """Rank ``rank``'s rank-unique input of ``count`` elements (float64; see the module docstring)."""
    if op in ("all_reduce", "broadcast", "reduce", "sendrecv"):
        return torch.full((count,), float(rank + 1), dtype=torch.float64)
    chunk = count // world
    if op == "all_gather":  # the input is one chunk
        return torch.full((chunk,), float(rank + 1), dtype=torch.float64)
    index = torch.arange(world, dtype=torch.float64).repeat_interleave(chunk)  # chunk number of each element
    if op == "reduce_scatter":
        return rank + 1 + index
    if op == "all_to_all":
        return world * rank + index + 1
    raise ValueError(f"unknown op {op!r}")


def expected_output(op: str, rank: int, world: int, count: int) -> torch.Tensor | None:
    """The closed-form result on ``rank`` (float64), or None where the op leaves it unspecified (reduce off rank 0)."""
    total = world * (world + 1) / 2
    chunk = count // world
    index = torch.arange(world, dtype=torch.float64).repeat_interleave(chunk)
    if op == "all_reduce":
        return torch.full((count,), total, dtype=torch.float64)
    if op == "all_gather":
        return index + 1
    if op == "reduce_scatter":
        return torch.full((chunk,), total + world * rank, dtype=torch.float64)
    if op == "all_to_all":
        return world * index + rank + 1
    if op == "broadcast":
        return torch.ones(count, dtype=torch.float64)
    if op == "reduce":
        return torch.full((count,), total, dtype=torch.float64) if rank == 0 else None
    if op == "sendrecv":
        return torch.full((count,), float((rank - 1) % world + 1), dtype=torch.float64)
    raise ValueError(f"unknown op {op!r}")


def check_result(actual: torch.Tensor, expected: torch.Tensor | None, dtype: torch.dtype, world: int) -> bool:
    """Is ``actual`` (any device, ``dtype``) the closed-form ``expected``? Exact for integer dtypes; floats within
    ``world`` rounding steps (eps of ``dtype``) of it: float32/64 sums of these small integers are exact, bfloat16
    and float16 round large ones."""
    if expected is None:
        return True
    if tuple(actual.shape) != tuple(expected.shape):
        return False
    got = actual.detach().to("cpu", torch.float64)
    if not dtype.is_floating_point:
        return torch.equal(got, expected)
    rtol = world * torch.finfo(dtype).eps
    return bool(torch.isclose(got, expected, rtol=rtol, atol=0).all())


@dataclass
class Row:
    op: str
    requested_bytes: int
    bytes: int
    count: int
    check: str
    time_us: float | None = None  # the slowest rank's mean over --iters
    time_us_per_rank: list[float] | None = None
    algbw_GBps: float | None = None
    busbw_GBps: float | None = None
    bus_factor: float | None = None


HEADER = f"{'op':>15} {'bytes':>12} {'count':>11} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}  check"


def format_row(row: Row) -> str:
    """One table line: op, bytes, count, time in µs, algbw and busbw in GB/s, check."""
    if row.time_us is None:
        numbers = f"{'-':>11} {'-':>13} {'-':>13}"
    else:
        numbers = f"{row.time_us:11.1f} {row.algbw_GBps:13.4g} {row.busbw_GBps:13.4g}"
    return f"{row.op:>15} {row.bytes:12d} {row.count:11d} {numbers}  {row.check}"


def format_table(rows: list[Row]) -> str:
    return "\n".join([HEADER, *(format_row(row) for row in rows)])


def summarize(
    rows: list[Row], world: int, backend: str, device: str, dtype: str, warmup: int, iters: int
) -> dict[str, Any]:
    """What --json and metrics.json hold: every row, and per op the peak busbw."""
    peaks: dict[str, float] = {}
    for row in rows:
        if row.busbw_GBps is not None:
            peaks[row.op] = max(peaks.get(row.op, 0.0), row.busbw_GBps)
    wrong = [row for row in rows if row.check == WRONG]
    return {
        "experiment": "commbench",
        "world_size": world,
        "backend": backend,
        "device": device,
        "dtype": dtype,
        "warmup": warmup,
        "iters": iters,
        "gb": "1e9 bytes",
        "rows": [asdict(row) for row in rows],
        "all_ok": not wrong,
        "wrong": len(wrong),
        "peak_busbw_GBps": peaks,
    }


# ---------------------------------------------------------------------------------------------- configuration


@dataclass
class CommbenchArgs(CommonArgs):
    ops: str = option(
        "all",
        "the ops to measure: all, or a comma-separated list",
        check=ops_problem,
        accepts="all or a comma-separated list of " + ", ".join(OPS),
    )
    min_bytes: int = option(
        KIB, "smallest message size S in bytes (see the docstring for what S is per op)", minimum=1, maximum=MAX_BYTES
    )
    max_bytes: int | None = option(
        None,
        f"largest message size S in bytes (default {DEFAULT_MAX_BYTES_CUDA} with CUDA, {DEFAULT_MAX_BYTES_CPU} on CPU)",
        minimum=1,
        maximum=MAX_BYTES,
        note="all_to_all holds two buffers of this size per process",
    )
    factor: int = option(2, "each size is the previous one times this", minimum=2, maximum=2**20)
    warmup: int = option(5, "untimed calls before the timed ones, per op and size", minimum=0, maximum=10**6)
    iters: int = option(20, "timed calls per op and size; a rank's time is their mean", minimum=1, maximum=10**6)
    dtype: str = option("float32", "element type of the buffers", choices=tuple(DTYPES))
    json: str = option(
        "",
        "also write the results to this JSON file (rank 0)",
        check=json_path_problem,
        accepts="a file path whose folder rank 0 can write into",
    )


def uses_cuda(backend: str) -> bool:
    return backend != "gloo" and torch.cuda.is_available()


def resolved_max_bytes(args: CommbenchArgs) -> int:
    if args.max_bytes is not None:
        return args.max_bytes
    return DEFAULT_MAX_BYTES_CUDA if uses_cuda(args.backend) else DEFAULT_MAX_BYTES_CPU


def validate(args: CommbenchArgs) -> None:
    """Each option's own range is declared above (parse_args checks it); here what spans several options."""
    check_values(args)
    max_bytes = resolved_max_bytes(args)
    require(
        args.min_bytes <= max_bytes,
        f"--min-bytes={args.min_bytes} is larger than --max-bytes={max_bytes}: it must be at most --max-bytes",
    )
    element = DTYPES[args.dtype].itemsize
    require(
        args.min_bytes >= element,
        f"--min-bytes={args.min_bytes} is smaller than one {args.dtype} element ({element} bytes): "
        f"it must be at least {element}",
    )


# ---------------------------------------------------------------------------------------------- the collectives


@dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor  # where the result lands; the same tensor as send for the in-place ops


def allocate(op: str, count: int, world: int, dtype: torch.dtype, device: torch.device) -> Buffers:
    chunk = count // world
    if op in ("all_reduce", "broadcast", "reduce"):
        buffer = torch.zeros(count, dtype=dtype, device=device)
        return Buffers(buffer, buffer)
    if op == "all_gather":
        return Buffers(torch.zeros(chunk, dtype=dtype, device=device), torch.zeros(count, dtype=dtype, device=device))
    if op == "reduce_scatter":
        return Buffers(torch.zeros(count, dtype=dtype, device=device), torch.zeros(chunk, dtype=dtype, device=device))
    if op in ("all_to_all", "sendrecv"):
        return Buffers(torch.zeros(count, dtype=dtype, device=device), torch.zeros(count, dtype=dtype, device=device))
    raise ValueError(f"unknown op {op!r}")


# torch 2.14 renamed these (the old names warn that they are deprecated); gloo runs all seven ops there
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sendrecv(b: Buffers, rank: int, world: int) -> None:
    ops = [dist.P2POp(dist.isend, b.send, (rank + 1) % world), dist.P2POp(dist.irecv, b.recv, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):  # one group: NCCL would deadlock on a separate send and recv at n=2
        work.wait()


COLLECTIVES: dict[str, Callable[[Buffers, int, int], None]] = {
    "all_reduce": lambda b, rank, world: dist.all_reduce(b.send, op=dist.ReduceOp.SUM),
    "all_gather": lambda b, rank, world: _all_gather(b.recv, b.send),
    "reduce_scatter": lambda b, rank, world: _reduce_scatter(b.recv, b.send, op=dist.ReduceOp.SUM),
    "all_to_all": lambda b, rank, world: dist.all_to_all_single(b.recv, b.send),
    "broadcast": lambda b, rank, world: dist.broadcast(b.send, src=0),
    "reduce": lambda b, rank, world: dist.reduce(b.send, dst=0, op=dist.ReduceOp.SUM),
    "sendrecv": _sendrecv,
}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op: str, requested: int, args: CommbenchArgs, ctx: DistContext) -> Row:
    """Collective: time ``op`` at ``requested`` bytes on every rank, check it, and agree on the row."""
    rank, world, dtype = ctx.rank, ctx.world_size, DTYPES[args.dtype]
    count = element_count(op, requested, dtype.itemsize, world)
    size = count * dtype.itemsize
    if op == "sendrecv" and world == 1:
        return Row(op, requested, size, count, "n/a (1 process)")
    call = COLLECTIVES[op]
    seconds, status = 0.0, OK
    try:
        buffers = allocate(op, count, world, dtype, ctx.device)
        for _ in range(args.warmup):
            call(buffers, rank, world)
        dist.barrier()
        _synchronize(ctx.device)
        started = time.perf_counter()
        for _ in range(args.iters):
            call(buffers, rank, world)
        _synchronize(ctx.device)
        seconds = (time.perf_counter() - started) / args.iters

        buffers.send.copy_(input_values(op, rank, world, count))
        call(buffers, rank, world)
        _synchronize(ctx.device)
        status = OK if check_result(buffers.recv, expected_output(op, rank, world, count), dtype, world) else WRONG
    except RuntimeError as error:
        if not any(word in str(error).lower() for word in UNSUPPORTED_WORDS):
            raise
        status = f"unsupported on {ctx.backend}"
    per_rank = all_gather_object((seconds, status))
    statuses = [s for _, s in per_rank]
    unsupported = [s for s in statuses if s.startswith("unsupported")]
    if unsupported:
        return Row(op, requested, size, count, unsupported[0])
    time_s = max(s for s, _ in per_rank)
    factor = bus_factor(op, world)
    algbw, busbw = bandwidths(size, time_s, factor)
    return Row(
        op,
        requested,
        size,
        count,
        OK if all(s == OK for s in statuses) else WRONG,
        time_us=time_s * 1e6,
        time_us_per_rank=[s * 1e6 for s, _ in per_rank],
        algbw_GBps=algbw,
        busbw_GBps=busbw,
        bus_factor=factor,
    )


class WrongResultError(RunStoppedError):
    """A collective gave another result than its closed form: the communication stack is broken."""

    exit_code = 1


def benchmark(args: CommbenchArgs) -> dict[str, Any]:
    with process_group(args.dist_config()) as ctx:
        summary = benchmark_in_group(args, ctx)
    if not summary["all_ok"]:
        wrong = [f"{row['op']} at {row['bytes']} bytes" for row in summary["rows"] if row["check"] == WRONG]
        raise WrongResultError(
            f"{len(wrong)} result(s) WRONG ({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''}) "
            f"on {summary['world_size']} process(es), {summary['backend']}: the table above names every row"
        )
    return summary


def benchmark_in_group(args: CommbenchArgs, ctx: DistContext) -> dict[str, Any]:
    setup_logging()
    run = start_run("commbench", args, ctx)
    heartbeat.started(run.dir)  # where its launcher keeps torch's output when a rank fails
    writer = run.open_writer()
    sizes = size_sweep(args.min_bytes, resolved_max_bytes(args), args.factor)
    ops = parse_ops(args.ops)
    log.info(
        "run directory %s; %d process(es), backend %s, device %s, %s, sizes %d..%d bytes (x%d), warmup %d, iters %d",
        run.dir,
        ctx.world_size,
        ctx.backend,
        ctx.device.type,
        args.dtype,
        sizes[0],
        sizes[-1],
        args.factor,
        args.warmup,
        args.iters,
    )
    print0(HEADER)
    rows = []
    for op in ops:
        for requested in sizes:
            row = measure(op, requested, args, ctx)
            rows.append(row)
            print0(format_row(row))
            if row.busbw_GBps is not None:
                step = round(math.log2(requested))
                writer.add_scalar(f"commbench/{op}/busbw_GBps", row.busbw_GBps, step)
                writer.add_scalar(f"commbench/{op}/algbw_GBps", row.algbw_GBps, step)
                writer.add_scalar(f"commbench/{op}/time_us", row.time_us, step)
    summary = summarize(rows, ctx.world_size, ctx.backend, ctx.device.type, args.dtype, args.warmup, args.iters)
    if args.json:  # every rank learns whether rank 0 could write it
        rank0_decides(lambda: write_json_atomic(Path(args.json), summary))
    writer.close()
    if summary["all_ok"]:
        run.finish(summary)
    log.info("done: %d rows, %d WRONG; %s (view: make tensorboard)", len(rows), summary["wrong"], run.dir)
    return summary


main = entry_main(CommbenchArgs, benchmark, doc=__doc__, validate=validate)

if __name__ == "__main__":
    main.run_and_exit()
