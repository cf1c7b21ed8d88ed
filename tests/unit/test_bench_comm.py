"""bench.comm without training: its statistics and table from made-up run figures, its schedule, the commands it
starts, what it reads from a run directory, and the probe's byte count on a real optimizer in this process.

Timings are never asserted; the made-up step times are chosen so that a ratio taken against the wrong
baseline (another round's, or a median of medians) gives a different number.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from bench import comm, comm_probe
from bench.comm_table import RunResult, markdown, per_seed_means, size, summarize
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE

MIB = 2**20


def result(variant: str, round_: int, step_s: float, **overrides) -> RunResult:
    figures = dict(
        experiment="charlm",
        variant=variant,
        round=round_,
        seed=round_,
        step_s=step_s,
        comm_bytes=4.0 * MIB,
        metric=1.0,
        state_bytes=(2 * MIB, 2 * MIB),
    )
    return RunResult(**{**figures, **overrides})


def three_rounds() -> list[RunResult]:
    """none's step time swings 10x between rounds; fp16 is 2x, 2.5x and 3x the none of its own round."""
    none_s = [0.1, 1.0, 0.4]
    results = [result("none", r, s, metric=m) for r, (s, m) in enumerate(zip(none_s, [0.80, 0.90, 0.85]))]
    results += [
        result("fp16", r, s * ratio, comm_bytes=2.0 * MIB, metric=m)
        for r, (s, ratio, m) in enumerate(zip(none_s, [2.0, 3.0, 2.5], [0.70, 0.90, 0.80]))
    ]
    results += [result("zero", r, s, state_bytes=(MIB + 10, MIB - 10)) for r, s in enumerate(none_s)]
    return results


def test_step_time_ratios_are_per_round_against_the_same_rounds_baseline():
    rows = {row.variant: row for row in summarize(three_rounds())}
    fp16 = rows["fp16"].step_ratio
    # the same round's none: 2, 3 and 2.5 exactly (a ratio of medians would be 0.8 / 0.4 = 2.0 for the median)
    assert (fp16.median, fp16.low, fp16.high) == pytest.approx((2.5, 2.0, 3.0))
    zero = rows["zero"].step_ratio
    assert (zero.median, zero.low, zero.high) == pytest.approx((1.0, 1.0, 1.0))
    assert rows["none"].step_ms == pytest.approx(400.0)  # the median of 100, 1000 and 400 ms


def test_bytes_state_and_metric_per_variant():
    rows = {row.variant: row for row in summarize(three_rounds())}
    assert rows["none"].comm_ratio == pytest.approx(1.0) and rows["fp16"].comm_ratio == pytest.approx(0.5)
    assert rows["fp16"].comm_bytes == pytest.approx(2.0 * MIB)
    assert rows["zero"].state_bytes == (MIB + 10, MIB - 10)
    assert rows["zero"].state_ratio == pytest.approx((MIB + 10) / (2 * MIB))  # the largest rank's share
    assert rows["fp16"].metric_mean == pytest.approx(0.8) and rows["fp16"].metric_sd == pytest.approx(0.1)
    assert rows["none"].metric_mean == pytest.approx(0.85) and rows["none"].metric_sd == pytest.approx(0.05)
    assert rows["none"].seeds == 3


def test_a_seed_run_in_two_rounds_counts_once_in_the_mean_and_sd():
    runs = [result("none", 0, 1.0, seed=0, metric=0.2), result("none", 1, 1.0, seed=1, metric=0.6)]
    runs.append(result("none", 2, 1.0, seed=0, metric=0.4))  # seed 0 again: its two runs average to 0.3
    assert per_seed_means(runs) == pytest.approx([0.3, 0.6])
    [row] = summarize(runs)
    assert row.seeds == 2 and row.metric_mean == pytest.approx(0.45)


def test_bytes_not_counted_by_this_ddp_core_show_as_n_a():
    runs = [result("none", 0, 1.0, comm_bytes=None), result("bf16", 0, 1.5, comm_bytes=None)]
    rows = summarize(runs)
    assert [row.comm_bytes for row in rows] == [None, None] and rows[1].comm_ratio is None
    table = markdown(rows, {"charlm": "loss"}, ["about"]).splitlines()
    assert table[5].split(" | ")[2] == "n/a" and table[5].split(" | ")[3] == "1.50× (1.50–1.50)"
    assert table[5].endswith("| loss 1.0000 ± n/a |")  # one seed: no sd


def test_a_round_without_its_baseline_or_twice_is_refused():
    with pytest.raises(ValueError, match="every round needs a 'none' run"):
        summarize([result("none", 0, 1.0), result("fp16", 0, 1.0), result("fp16", 1, 1.0)])
    with pytest.raises(ValueError, match="round 0 twice"):
        summarize([result("none", 0, 1.0), result("none", 0, 2.0)])


def test_the_table_has_a_row_per_variant():
    lines = markdown(summarize(three_rounds()), {"charlm": "loss"}, ["what ran", "how"]).splitlines()
    assert lines[:2] == ["what ran", "how"] and lines[3].startswith("| experiment | variant |")
    assert lines[5] == "| charlm | none | 4 MiB (1×) | 1 (400.0 ms/step) | 2 MiB each (1×) | loss 0.8500 ± 0.0500 |"
    assert lines[6] == "| charlm | fp16 | 2 MiB (0.5×) | 2.50× (2.00–3.00) | 2 MiB each (1×) | loss 0.8000 ± 0.1000 |"
    assert lines[7].split(" | ")[4] == "1 MiB / 1 MiB (0.5×)"  # per rank, in rank order
    assert len(lines) == 8


@pytest.mark.parametrize(
    ("count", "shown"),
    [(40, "40 B"), (2048, "2 KiB"), (912 * 1024, "912 KiB"), (1000 * 1024, "1000 KiB"), (MIB - 10, "1 MiB")],
)
def test_sizes_in_binary_units(count, shown):
    assert size(count) == shown


def test_every_round_runs_every_variant_once_in_a_rotated_order():
    jobs = comm.schedule(["cifar10", "charlm"], ["none", "fp16", "zero"], rounds=4, seeds=3)
    assert len(jobs) == 4 * 2 * 3
    firsts = [job.variant for job in jobs if job.experiment == "cifar10"][::3]
    assert firsts == ["none", "fp16", "zero", "none"]  # none is not always the first, cold run
    for r in range(4):
        in_round = [job for job in jobs if job.round == r]
        assert sorted((j.experiment, j.variant) for j in in_round) == sorted(
            (e, v) for e in ("cifar10", "charlm") for v in ("none", "fp16", "zero")
        )
        assert {job.seed for job in in_round} == {r % 3}


def test_each_variant_is_its_flags_through_the_projects_launcher(tmp_path: Path):
    args = comm.CommBenchArgs(powersgd_start_step=7)
    job = comm.Job("charlm", "powersgd", round=1, seed=1)
    command = comm.command(args, job, tmp_path / "run", tmp_path / "data")
    text = " ".join(command)
    assert "-m ddp_core.torchrun --standalone --nproc-per-node=2 -m bench.comm_probe experiments.charlm" in text
    assert "--seed 1" in text and "--comm-hook powersgd --powersgd-start-step 7" in text
    zero = " ".join(comm.command(args, comm.Job("cifar10", "zero", 0, 0), tmp_path / "run", tmp_path / "data"))
    assert "--comm-hook none --zero" in zero and f"--data-dir {tmp_path / 'data'} --no-verify" in zero
    assert "--powersgd-start-step" not in zero


def write_run(run_dir: Path, metrics: dict) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    probe = {"optimizer_bytes": [{"state": 300}, {"state": 200}]}
    (run_dir / comm_probe.PROBE_FILE).write_text(json.dumps(probe))


def test_what_is_read_from_a_run_directory(tmp_path: Path):
    metrics = {"global_batch_size": 64, "images_per_s": 320.0, "eval_accuracy": 0.75, "comm_bytes_per_step": 1024}
    write_run(tmp_path / "a", metrics)
    read = comm.read_result(comm.Job("cifar10", "zero", 2, 2), tmp_path / "a")
    assert read.step_s == pytest.approx(0.2) and read.metric == 0.75 and read.comm_bytes == 1024.0
    assert read.state_bytes == (300, 200) and read.round == 2
    write_run(tmp_path / "b", {"global_batch_size": 32, "samples_per_s": 64.0, "eval_loss": 1.5})
    read = comm.read_result(comm.Job("charlm", "none", 0, 0), tmp_path / "b")
    assert read.comm_bytes is None and read.step_s == pytest.approx(0.5) and read.metric == 1.5


def test_the_probe_counts_an_optimizers_state_tensors_once_each():
    model = torch.nn.Linear(100, 10)  # 1010 float32 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert comm_probe.optimizer_state_bytes(optimizer) == {"state": 0}  # before the first step
    model(torch.randn(4, 100)).sum().backward()
    optimizer.step()
    assert comm_probe.optimizer_state_bytes(optimizer) == {"state": 1010 * 4}  # momentum
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    optimizer.state[model.bias]["alias"] = buffer[0]  # a view of a storage already counted adds nothing
    assert comm_probe.optimizer_state_bytes(optimizer)["state"] == 1010 * 4


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--variants", "fp16,bf16"], "--variants='fp16,bf16'"),
        (["--variants", "none,none"], "--variants='none,none'"),
        (["--variants", "none,int8"], "--variants='none,int8'"),
        (["--experiments", "toy"], "--experiments='toy'"),
        (["--nproc", "1"], "--nproc=1"),
        (["--seeds", "0"], "--seeds=0"),
        (["--powersgd-start-step", "1"], "--powersgd-start-step=1"),
        (["--nproc", "4", "--cifar-images", "100"], "--cifar-images=100 is less than one step of 128 images"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_info:
        comm.main(argv)  # refused while parsing: nothing is run
    assert exit_info.value.code == CONFIG_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and names in err, err


def test_make_bench_runs_it():
    source = open(os.path.join(os.path.dirname(comm.__file__), "__main__.py")).read()
    run = re.search(r"for module in \(([^)]*)\):\n\s+.*\n\s+module\.main\(\[\]\)", source)
    assert run is not None and "comm" in run[1].split(", ")
