"""tools.commbench (experiments.commbench's code) without a process group: the bandwidth formulas, the size
sweep, the closed-form inputs and results, the table, and the flags refused with exit 2 and one line."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_core.config import parse_args
from tools import commbench
from tools.commbench import (
    OPS,
    Row,
    bandwidths,
    bus_factor,
    check_result,
    element_count,
    expected_output,
    format_row,
    format_table,
    input_values,
    size_sweep,
    summarize,
)

# ------------------------------------------------------------------------------------- bus-bandwidth factors

# nccl-tests (doc/PERFORMANCE.md): 2(n-1)/n for all_reduce; (n-1)/n for all_gather, reduce_scatter and
# all_to_all; 1 for broadcast, reduce and send/recv. Written out as fractions, not with the formula.
EXPECTED_FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5},
    3: {"all_reduce": 4 / 3, "all_gather": 2 / 3, "reduce_scatter": 2 / 3, "all_to_all": 2 / 3},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875},
}


@pytest.mark.parametrize("world", sorted(EXPECTED_FACTORS))
def test_bus_factors(world):
    expected = {**EXPECTED_FACTORS[world], "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0}
    assert set(expected) == set(OPS)
    for op, factor in expected.items():
        assert bus_factor(op, world) == pytest.approx(factor, rel=1e-15), op


def test_bus_factor_of_a_world_of_one_and_an_unknown_op():
    assert bus_factor("all_reduce", 1) == 0 and bus_factor("all_gather", 1) == 0 and bus_factor("broadcast", 1) == 1
    with pytest.raises(ValueError, match="unknown op"):
        bus_factor("gather", 2)


@pytest.mark.parametrize(
    "size, seconds, factor, algbw, busbw",
    [
        (10**9, 1.0, 1.0, 1.0, 1.0),  # 1 GB in 1 s: 1 GB/s (1 GB = 1e9 bytes, as nccl-tests)
        (2**30, 0.5, 1.5, 2.147483648, 3.221225472),
        (1024, 1e-3, 0.5, 0.001024, 0.000512),  # 1 KiB in 1 ms
        (64 * 2**20, 2e-3, 2 * 7 / 8, 33.554432, 58.720256),
    ],
)
def test_algbw_and_busbw_from_bytes_and_time(size, seconds, factor, algbw, busbw):
    got = bandwidths(size, seconds, factor)
    assert got == pytest.approx((algbw, busbw), rel=1e-12)


def test_bandwidth_needs_a_positive_time():
    for seconds in (0.0, -1.0):
        with pytest.raises(ValueError):
            bandwidths(1024, seconds, 1.0)


# ------------------------------------------------------------------------------------------- the size sweep


@pytest.mark.parametrize(
    "lo, hi, factor, sizes",
    [
        (1024, 1024, 2, [1024]),  # min == max: one size
        (1024, 8192, 2, [1024, 2048, 4096, 8192]),  # max hit exactly: included
        (1024, 8191, 2, [1024, 2048, 4096]),  # max not hit: the last size <= max, as nccl-tests
        (1024, 2047, 2, [1024]),
        (8, 1000, 10, [8, 80, 800]),
        (3, 81, 3, [3, 9, 27, 81]),
        (1, 2**36, 2, [2**k for k in range(37)]),
        (100, 10**6, 2**20, [100]),  # a factor past max: one size
    ],
)
def test_size_sweep(lo, hi, factor, sizes):
    assert size_sweep(lo, hi, factor) == sizes


@pytest.mark.parametrize("lo, hi, factor", [(2048, 1024, 2), (1024, 4096, 1), (1024, 4096, 0), (0, 4096, 2)])
def test_size_sweep_refuses_what_validate_refuses(lo, hi, factor):
    with pytest.raises(ValueError):
        size_sweep(lo, hi, factor)


@pytest.mark.parametrize(
    "op, size, element, world, count",
    [
        ("all_reduce", 1024, 4, 3, 256),
        ("all_gather", 1024, 4, 3, 255),  # a multiple of the world size: 85 elements from each rank
        ("reduce_scatter", 1024, 4, 4, 256),
        ("all_to_all", 1024, 8, 3, 126),
        ("all_gather", 4, 4, 4, 4),  # below one element per rank: one element per rank
        ("broadcast", 6, 4, 2, 1),  # a partial element is dropped
        ("sendrecv", 4, 4, 8, 1),
    ],
)
def test_element_count(op, size, element, world, count):
    assert element_count(op, size, element, world) == count


# ------------------------------------------------------------------------ the closed-form inputs and results


def simulate(op: str, world: int, count: int) -> list[torch.Tensor | None]:
    """What each rank holds after ``op`` on ``input_values``, computed the slow, obvious way."""
    inputs = [input_values(op, r, world, count) for r in range(world)]
    chunk = count // world
    if op == "all_reduce":
        return [sum(inputs) for _ in range(world)]
    if op == "all_gather":
        return [torch.cat(inputs) for _ in range(world)]
    if op == "reduce_scatter":
        return [sum(x[r * chunk : (r + 1) * chunk] for x in inputs) for r in range(world)]
    if op == "all_to_all":
        return [torch.cat([inputs[s][r * chunk : (r + 1) * chunk] for s in range(world)]) for r in range(world)]
    if op == "broadcast":
        return [inputs[0].clone() for _ in range(world)]
    if op == "reduce":
        return [sum(inputs)] + [None] * (world - 1)
    if op == "sendrecv":
        return [inputs[(r - 1) % world] for r in range(world)]
    raise AssertionError(op)


@pytest.mark.parametrize(
    ("op", "world"), [(op, world) for op in OPS for world in (1, 2, 3, 4, 8) if not (op == "sendrecv" and world == 1)]
)
def test_expected_output_is_what_the_op_computes(op, world):  # a send/recv ring needs 2 processes
    count = element_count(op, 96, 4, world)
    simulated = simulate(op, world, count)
    for rank in range(world):
        expected = expected_output(op, rank, world, count)
        if simulated[rank] is None:
            assert expected is None
        else:
            assert expected is not None and torch.equal(expected, simulated[rank]), (op, rank)


@pytest.mark.parametrize("op", ["all_gather", "all_to_all", "reduce_scatter", "sendrecv", "all_reduce"])
def test_results_are_rank_unique_so_a_swap_is_caught(op):
    """Two ranks' results (or two chunks) must differ, else a collective that mixed them up would pass."""
    world = 3
    count = element_count(op, 48, 4, world)
    outputs = [expected_output(op, r, world, count) for r in range(world)]
    if op in ("all_gather", "all_reduce"):  # every rank holds the same result: its chunks (ranks' data) must differ
        chunks = outputs[0].chunk(world)
        assert op == "all_reduce" or len({float(c[0]) for c in chunks}) == world
    else:
        assert len({tuple(o.tolist()) for o in outputs}) == world


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
)
def test_check_result_accepts_the_right_result_and_catches_a_wrong_one(dtype):
    world, count = 4, 64
    for op in OPS:
        count_op = element_count(op, count * 4, 4, world)
        expected = expected_output(op, 1, world, count_op)
        if expected is None:
            continue
        right = expected.to(dtype)
        assert check_result(right, expected, dtype, world), (op, dtype)
        for corrupt in (lambda t: t.__setitem__(-1, t[-1] + 1), lambda t: t.__setitem__(0, 0), lambda t: t.mul_(2)):
            wrong = right.clone()
            corrupt(wrong)
            assert not check_result(wrong, expected, dtype, world), (op, dtype)
        assert not check_result(right[:-1], expected, dtype, world)  # a wrong shape


def test_check_result_of_reduce_off_the_root_is_unspecified():
    assert expected_output("reduce", 1, 3, 12) is None
    assert check_result(torch.full((12,), 123.0), None, torch.float32, 3)


def test_low_precision_rounding_is_tolerated_but_not_an_off_by_one():
    """bfloat16 holds integers exactly only up to 256; a sum of 64 ranks' data rounds."""
    world, count = 63, 63
    expected = expected_output("reduce_scatter", 62, world, count)  # 63*64/2 + 63*62 = 5922
    assert expected.tolist() == [5922.0]
    rounded = expected.to(torch.bfloat16)
    assert float(rounded[0]) != 5922  # rounding really happens here
    assert check_result(rounded, expected, torch.bfloat16, world)
    assert not check_result(torch.full((1,), 5922.0 * 2, dtype=torch.bfloat16), expected, torch.bfloat16, world)
    assert not check_result(torch.full((1,), 5923, dtype=torch.int64), expected, torch.int64, world)


# ------------------------------------------------------------------------------------------------- the table


def test_table_row_and_summary():
    factor = bus_factor("all_reduce", 4)
    algbw, busbw = bandwidths(4 * 2**20, 2e-3, factor)
    row = Row(
        "all_reduce", 4 * 2**20, 4 * 2**20, 2**20, "ok", 2000.0, [1900.0, 2000.0, 1950.0, 1990.0], algbw, busbw, factor
    )
    skipped = Row("sendrecv", 1024, 1024, 256, "n/a (1 process)")
    wrong = Row("broadcast", 1024, 1024, 256, "WRONG", 50.0, [50.0], 0.02048, 0.02048, 1.0)
    table = format_table([row, skipped, wrong]).splitlines()
    assert table[0].split() == ["op", "bytes", "count", "time", "(us)", "algbw", "(GB/s)", "busbw", "(GB/s)", "check"]
    assert table[1].split() == ["all_reduce", "4194304", "1048576", "2000.0", "2.097", "3.146", "ok"]
    assert table[2].split() == ["sendrecv", "1024", "256", "-", "-", "-", "n/a", "(1", "process)"]
    assert table[3].split()[-1] == "WRONG"
    assert format_row(row) == table[1]

    summary = summarize([row, skipped, wrong], 4, "gloo", "cpu", "float32", 5, 20)
    assert summary["all_ok"] is False and summary["wrong"] == 1
    assert summary["peak_busbw_GBps"] == {"all_reduce": pytest.approx(busbw), "broadcast": pytest.approx(0.02048)}
    assert [r["op"] for r in summary["rows"]] == ["all_reduce", "sendrecv", "broadcast"]
    assert summarize([row], 4, "gloo", "cpu", "float32", 5, 20)["all_ok"] is True


# ----------------------------------------------------------------------------------- flags refused with exit 2


@pytest.mark.parametrize(
    "argv, mentions",
    [
        (["--min-bytes", "4096", "--max-bytes", "1024"], "--min-bytes=4096 is larger than --max-bytes=1024"),
        (["--min-bytes", "2"], "--min-bytes=2 is smaller than one float32 element"),
        (["--min-bytes", "4", "--dtype", "float64"], "--min-bytes=4 is smaller than one float64 element"),
        (["--min-bytes", "0"], "--min-bytes=0 is out of range"),
        (["--min-bytes", "-1"], "--min-bytes=-1 is out of range"),
        (["--max-bytes", str(2**40)], "--max-bytes=1099511627776 is out of range"),
        (["--factor", "1"], "--factor=1 is out of range: it must be an integer in 2..2**20"),
        (["--factor", "0"], "--factor=0 is out of range"),
        (["--factor", "1.5"], "--factor='1.5' is not an integer"),
        (["--ops", "all_reduce,gather"], "--ops='all_reduce,gather' names an unknown op ('gather')"),
        (["--ops", "allreduce"], "names an unknown op ('allreduce')"),
        (["--ops", "all_reduce,,broadcast"], "names an unknown op ('')"),
        (["--ops="], "--ops='' is empty"),
        (["--dtype", "int8"], "--dtype='int8' is not one of float32"),
        (["--iters", "0"], "--iters=0 is out of range"),
        (["--warmup", "-1"], "--warmup=-1 is out of range"),
        (["--json", "."], "--json='.' is a directory"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
    ids=lambda value: value if isinstance(value, str) else " ".join(value),
)
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest's captured stderr
def test_bad_flags_exit_2_with_one_line(clean_env, capsys, argv, mentions):
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        commbench.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert mentions in lines[0], lines[0]
    assert captured.out == ""


def test_defaults_are_accepted_and_the_cpu_sweep_is_small(clean_env):
    args = parse_args(commbench.CommbenchArgs, ["--backend", "gloo"])
    commbench.validate(args)
    sizes = size_sweep(args.min_bytes, commbench.resolved_max_bytes(args), args.factor)
    assert sizes[0] == 1024 and sizes[-1] == commbench.DEFAULT_MAX_BYTES_CPU and len(sizes) == 13
    assert commbench.parse_ops(args.ops) == list(OPS)
    assert commbench.parse_ops("reduce, all_reduce,reduce") == ["reduce", "all_reduce"]
    explicit = parse_args(commbench.CommbenchArgs, ["--max-bytes", "4096"])
    assert commbench.resolved_max_bytes(explicit) == 4096
    assert math.log2(commbench.DEFAULT_MAX_BYTES_CUDA) == 26  # 64 MiB with CUDA
