"""make gpu-check: what it reads out of each check's output, how it judges, the table, the no-CUDA exit.

The canned outputs below are copied from real runs (an H100 and this repository's 2-core CPU machine);
`python -m bench.gpu_check --allow-cpu` runs the whole orchestration on CPU (about 90 s: not here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check, gpu_gaps, step_overhead
from bench.gpu_check import Check, Finished, cpu_sizes, gpu_sizes, judge, plan, select, training_flops_per_image
from bench.gpu_report import (
    FAIL,
    PASS,
    SKIP,
    Reading,
    Row,
    epoch_images_per_s,
    last_error_line,
    peak_flops,
    read_bench_ddp,
    read_bench_ddp_overhead,
    read_bench_models,
    read_bench_pipeline,
    read_bench_step_overhead,
    read_cifar,
    read_collectives,
    read_profile,
    read_pytest,
    read_toy,
    render_markdown,
    render_table,
    step_matrix,
)
from tests import prefork

REPO = Path(__file__).resolve().parents[2]

TORCHRUN_FAILURE = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/app/experiments/toy.py", line 140, in train_in_group
[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered
E1123 05:50:00 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1) \
local_rank: 0 (pid: 573) of binary: python3
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
experiments.toy FAILED
------------------------------------------------------------
Root Cause (first observed failure):
  error_file: /tmp/torchelastic_x/error.json
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

CIFAR_OUTPUT = """\
05:52:10 [rank 0] INFO resnet18 on 1 process(es), nccl/cuda, global batch 512, peak lr 0.4, 97 steps per epoch, amp True
05:52:14 [rank 0] INFO epoch 1/3  step 97  eval accuracy 0.9120  eval loss 0.4100  16494 images/s  (10000 test images)
05:52:16 [rank 0] INFO epoch 2/3  step 194  eval accuracy 0.9990  eval loss 0.0900  31765 images/s  (10000 test images)
05:52:18 [rank 0] INFO epoch 3/3  step 291  eval accuracy 1.0000  eval loss 0.0867  31556 images/s  (10000 test images)
"""

BENCH_DDP = """\
ddp-lab benchmarks: torch 2.14.1+cu130, 2 processes, gloo, cpu

1. all-gather of 32 tensors of shape (1, 64), 2 ranks, gloo
   one collective (all_gather_tensors)         0.555 ms      1.0x the one-collective time
   loop of 32 all_gather                      10.468 ms     18.9x the one-collective time
   all_gather_object(list)                     7.871 ms     14.2x the one-collective time

2. toy training step, batch 32 per process, 2 ranks, gloo
   DDP step (gradient all-reduce)             2374.7 us
   same step, no communication                 485.3 us
   communication share of the DDP step: 80%  (DDP step = 4.9x the local step)
"""

BENCH_PIPELINE = """\
CIFAR10 input pipeline, CPU, 512 images in memory, batch 128, 1 torch thread(s), torchvision DataLoader workers: 0
   batches timed per pipeline: 4 (batch 128)
   tensor (resident, batched ops)               41,476 images/s
   torchvision (Dataset/DataLoader/PIL)          3,725 images/s
   tensor / torchvision: 11.1x  (median of 1 alternating epochs each)
"""

BENCH_MODELS = """\
CIFAR10 training step, CPU, batch 8, 1 torch thread(s), one process
   resnet18   11.17 M parameters     465.4 ms/step        17 images/s
   small       0.24 M parameters      27.6 ms/step       289 images/s
"""


def summary(*outcomes: tuple[str, str]) -> str:
    return "Rank 1: after the barrier\nTrue\n\n\nSummary:\n" + "".join(
        f"  {name:20s} {outcome}\n" for name, outcome in outcomes
    )


def write_metrics(run_dir: Path, **metrics: object) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    return run_dir


# ------------------------------------------------------------------------------------------- errors


def test_the_error_line_is_the_workers_exception_not_torchruns_summary():
    assert (
        last_error_line(TORCHRUN_FAILURE)
        == "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered"
    )


def test_a_worker_killed_by_a_signal_is_named_by_torchruns_summary():
    killed = TORCHRUN_FAILURE.replace(
        "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered\n", ""
    )
    assert last_error_line(killed).endswith("failed (exitcode: 1) local_rank: 0 (pid: 573) of binary: python3")
    signalled = killed + "  traceback : Signal 9 (SIGKILL) received by PID 573\n"
    assert last_error_line(signalled) == "traceback : Signal 9 (SIGKILL) received by PID 573"


def test_the_error_line_prefers_pytests_failure_summary_and_falls_back_to_the_last_line():
    pytest_output = (
        "FAILED tests/gpu/test_nccl.py::test_toy - AssertionError: torchrun failed (1)\n1 failed, 1 passed in 9.1s\n"
    )
    assert last_error_line(pytest_output).startswith("FAILED tests/gpu/test_nccl.py::test_toy - AssertionError")
    assert last_error_line("starting\nstill going\n") == "still going"
    assert last_error_line("") == "(no output)"
    assert len(last_error_line("error: " + "x" * 500)) == 200


# ------------------------------------------------------------------------------------------ readers


def test_toy_reads_the_final_loss_from_metrics_json(tmp_path):
    assert read_toy(write_metrics(tmp_path / "ok", final_loss=0.02920074)).figure == "final loss 0.0292"
    nan = read_toy(write_metrics(tmp_path / "nan", final_loss=float("nan")))
    assert nan.status == FAIL and "not finite" in nan.error
    missing = read_toy(tmp_path / "never-written")
    assert missing.status == FAIL and "metrics.json" in missing.error


def test_collectives_counts_the_summary_block():
    ok = read_collectives(
        summary(("all_gather", "ok"), ("reduce_scatter", "ok"), ("all_to_all", "unsupported on gloo"))
    )
    assert ok.status is None and ok.figure == "2/3 demos ok, 1 unsupported"
    failed = read_collectives(summary(("all_gather", "ok"), ("scatter", "FAILED on rank 1: got [0.0]")))
    assert failed.status == FAIL and failed.error == "scatter: FAILED on rank 1: got [0.0]"
    assert read_collectives("=== all_gather ===\n").status == FAIL


def test_cifar_reports_best_and_last_epoch_mean_accuracy_and_peak_memory(tmp_path):
    assert epoch_images_per_s(CIFAR_OUTPUT) == [16494.0, 31765.0, 31556.0]
    run_dir = write_metrics(tmp_path, images_per_s=24233.1, eval_accuracy=0.99987, peak_gpu_memory_gib=1.54, amp="bf16")
    reading = read_cifar(CIFAR_OUTPUT, run_dir, gpus=1)
    assert reading.status is None
    assert (
        reading.figure
        == "best epoch 31,765 img/s (goal 50,000/H100); last 31,556; steady 24,233; acc 1.000; amp bf16; "
        "peak mem 1.5 GiB"
    )
    assert reading.details["epoch_images_per_s"] == [16494.0, 31765.0, 31556.0]


def test_cifar_without_peak_memory_says_na_and_without_epochs_fails(tmp_path):
    no_memory = CIFAR_OUTPUT  # metrics.json without peak_gpu_memory_gib: a CPU run
    assert read_cifar(no_memory, tmp_path, gpus=0).figure.endswith("peak mem n/a")
    assert "goal" not in read_cifar(no_memory, tmp_path, gpus=0).figure  # the goal is a GPU figure
    assert "/GPU" in read_cifar(CIFAR_OUTPUT, tmp_path, gpus=2).figure
    assert read_cifar("Traceback ...\n", tmp_path, gpus=1).status == FAIL


def test_benchmark_readers_quote_their_ratios():
    assert (
        read_bench_ddp(BENCH_DDP).figure
        == "2 procs, gloo/cpu: DDP step 4.9x the no-comm step; loop of all_gather 18.9x one collective"
    )
    assert read_bench_pipeline(BENCH_PIPELINE).figure == "CPU: tensor pipeline 41,476 img/s, 11.1x torchvision"
    assert read_bench_models(BENCH_MODELS).figure == "CPU, 1 thread: resnet18 17 img/s, small 289 img/s"
    for reader in (read_bench_ddp, read_bench_pipeline, read_bench_models, read_bench_ddp_overhead):
        assert reader("a format nobody parses\n").status == FAIL


def test_the_ddp_overhead_reader_reads_what_the_benchmark_prints():
    """Round trip through bench.ddp_overhead's own table: a change of its format fails here, not on a GPU box."""
    from bench.ddp_overhead import markdown

    def row(model: str, variant: str, bucket: float, accum: int, ddp: float, local: float) -> dict:
        return {
            "model": model,
            "variant": variant,
            "bucket_cap_mb": bucket,
            "grad_accum": accum,
            "buckets": 2,
            "gradients_mb": 42.6,
            "ddp_ms": ddp,
            "no_comm_ms": local,
            "ratio": ddp / local,
        }

    rows = [
        row("resnet18", "bucket 25 MB (default)", 25, 1, 53.0, 50.0),
        row("resnet18", "bucket 1 MB", 1, 1, 60.0, 50.0),
        row("resnet18", "bucket 25 MB, grad accum 4", 25, 4, 202.0, 200.0),
        row("small", "bucket 25 MB (default)", 25, 1, 12.0, 10.0),
    ]
    output = "noise before\n" + markdown(
        {
            "world_size": 4,
            "backend": "nccl",
            "device": "cuda",
            "torch": "2.14.1",
            "batch_size": 256,
            "rounds": 5,
            "steps": 3,
            "threads": 1,
            "sync_bn": True,
            "rows": rows,
        }
    )
    reading = read_bench_ddp_overhead(output)
    assert reading.status != FAIL, reading.error  # None: judged by the exit code
    assert reading.figure == "4 procs, nccl/cuda: DDP ÷ no-comm resnet18 1.06x (1.01x with grad accum), small 1.20x"
    assert reading.details["resnet18, bucket 1 MB"] == 1.2


# the table as bench.step_overhead prints it (its own render), for the reader to parse
STEP_OVERHEAD_OUTPUT = step_overhead.render(
    [
        step_overhead.Row("eager", "bare", [66_100, 66_533, 66_900]),
        step_overhead.Row("eager", "run", [62_000, 63_000, 63_500], paired=[0.93, 0.947, 0.95]),
        step_overhead.Row("compile", "bare", [93_000, 93_515, 94_000]),
        step_overhead.Row("compile", "run", [89_000, 90_000, 91_000], paired=[0.95, 0.962, 0.97]),
    ],
    "step overhead: resnet18, batch 1024, cuda, one process of 8 torch thread(s), 50000 training images; "
    "median (min-max) of n samples",
)


def test_the_step_overhead_reader_quotes_the_experiment_over_the_bare_step_per_mode():
    reading = read_bench_step_overhead(STEP_OVERHEAD_OUTPUT)
    assert reading.figure == (
        "(d)/(a) eager 0.95; (d)/(a) compile 0.96; best (d) compile 90,000 img/s = 0.96 of the best bare"
    )
    assert reading.details["eager (a)"] == {"images_per_s": 66533.0, "ratio": 1.0, "ratio_to_best_bare": 0.711}
    assert read_bench_step_overhead("step overhead: nothing measured").status == FAIL


def test_the_profile_reader_names_the_top_operation_and_checks_each_trace_exists(tmp_path):
    trace = tmp_path / "rank0.json"
    line = f"x INFO profile of steps 50..54 on rank 0: {trace} (Perfetto opens it); its top 15 operations by"
    output = (
        line
        + """ self device time:
-------------------------  ------------  ------------
                     Name    Self CPU %      Self CPU
-------------------------  ------------  ------------
aten::convolution_backward        46.62%        2.171s
"""
    )
    assert read_profile(output).status == FAIL  # announced, not written
    trace.write_text("{}")
    reading = read_profile(output)
    assert reading.status is None and reading.details["traces"] == [str(trace)]
    assert reading.figure == (
        f"steps 50..54, 1 rank(s); top by self device time: aten::convolution_backward 46.62% 2.171s; {trace}"
    )
    assert read_profile("no profile here").status == FAIL


def test_the_profile_reader_says_how_busy_the_gpu_was_and_what_the_host_did_while_it_waited(tmp_path):
    """bench.gpu_gaps on rank 0's trace (its own tests hold its arithmetic): 100 us of kernels in a window of
    400, the wait before the second launched late while the host ran the optimizer."""
    trace = tmp_path / "rank0.json"

    def event(name: str, category: str, start: float, end: float, **args: int) -> dict:
        return {
            "ph": "X",
            "cat": category,
            "name": name,
            "pid": 1,
            "tid": 1,
            "ts": start,
            "dur": end - start,
            "args": args,
        }

    events = [
        event("k1", "kernel", 0, 50, correlation=1),
        event("Optimizer.step#SGD.step", "user_annotation", 60, 340),
        event("cudaLaunchKernel", "cuda_runtime", 340, 341, correlation=2),
        event("k2", "kernel", 350, 400, correlation=2),
    ]
    trace.write_text(json.dumps({"traceEvents": events}))
    line = f"x INFO profile of steps 50..54 on rank 0: {trace} (Perfetto opens it); its top 15 operations by"
    reading = read_profile(line + " self device time:\n")
    assert reading.figure == (
        "steps 50..54, 1 rank(s); top by self device time: n/a; GPU busy 25%, waiting most while the host ran "
        f"Optimizer.step#SGD.step; {trace}"
    )
    assert reading.details["gpu_busy"] == 0.25
    assert reading.details["gpu_waited_for"] == {"Optimizer.step#SGD.step": 280, gpu_gaps.BETWEEN: 10}


def test_pytest_exit_5_is_no_gpu_tests_yet_and_all_skipped_is_a_skip():
    assert read_pytest(5, "no tests ran in 0.1s\n") == Reading(figure="no gpu tests yet", status=SKIP)
    skipped = read_pytest(
        0, "SKIPPED [1] tests/gpu/test_nccl.py:19: needs CUDA\n2 skipped, 1064 deselected in 14.03s\n"
    )
    assert skipped.status == SKIP and skipped.figure == "2 skipped (needs CUDA)"
    assert read_pytest(0, "..\n2 passed, 1064 deselected in 52.6s\n").figure == "2 passed"
    failed = read_pytest(1, "FAILED tests/gpu/test_nccl.py::test_toy - boom\n1 failed, 1 passed in 9.0s\n")
    assert failed.status is None and failed.figure == "1 failed, 1 passed"
    assert read_pytest(1, "/usr/bin/python3: No module named pytest\n").status == SKIP


# ---------------------------------------------------------------------------------- judging, table


def check(reading: Reading) -> Check:
    return Check("probe", ["true"], 60, lambda rc, output: reading)


def test_judge_a_skip_wins_then_the_exit_code_then_the_readers_fail():
    assert judge(check(Reading(status=SKIP)), Finished(5, "", 1.0, False)).status == SKIP
    crashed = judge(check(Reading(figure="x")), Finished(1, TORCHRUN_FAILURE, 1.0, False))
    assert crashed.status == FAIL and crashed.error.startswith("exit 1: ") and crashed.figure == "x"
    timed_out = judge(check(Reading()), Finished(-15, "step 3\n", 60.0, True))
    assert timed_out.status == FAIL and timed_out.error.startswith("timed out after 60 s")
    hollow = judge(check(Reading(status=FAIL, error="no metrics.json")), Finished(0, "", 1.0, False))
    assert (hollow.status, hollow.error) == (FAIL, "no metrics.json")
    assert judge(check(Reading(figure="fine")), Finished(0, "", 2.5, False)) == Row("probe", PASS, "fine", 2.5)


def test_the_table_has_one_line_per_check_and_an_error_only_for_a_fail():
    rows = [
        Row("toy", PASS, "final loss 0.0292", 22.1),
        Row("bench.ddp", FAIL, "", 3.0, error="exit 2: error: a | b"),
        Row("pytest -m gpu", SKIP, "no gpu tests yet", 1.0, error="ignored"),
    ]
    lines = render_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[2].split()[:2] == ["toy", "PASS"] and "22.1" in lines[2]
    assert lines[3].rstrip().endswith("exit 2: error: a | b")
    assert "ignored" not in lines[4]
    markdown = render_markdown(rows, "gpu-check: 1x H100", ["torch x"])
    assert markdown.startswith("## gpu-check: 1x H100\n\ntorch x\n")
    assert "| bench.ddp | FAIL | - | 3.0 | exit 2: error: a \\| b |" in markdown


# ------------------------------------------------------------------------------------------ the plan

MATRIX = [
    f"cifar10 resnet18 {mode} batch {batch}" for batch in (256, 512, 1024) for mode in ("eager", "compile", "graphs")
]


def test_the_gpu_plan_runs_nccl_on_every_gpu_with_the_issues_cifar_settings(tmp_path):
    checks = {c.name: c for c in plan(gpu_sizes(4), tmp_path)}
    assert list(checks) == [
        "toy",
        "collectives",
        *MATRIX,
        "cifar10 resnet18 eager sync-bn=global",
        "cifar10 resnet18 compile sync-bn=torch",
        "profile cifar10 resnet18",
        "bench.ddp",
        "bench.cifar10_pipeline",
        "bench.model_speed",
        "bench.ddp_overhead",
        "bench.step_overhead",
        "pytest -m gpu",
    ]
    assert not any(c.skip for c in checks.values())
    assert all(c.command[0] == sys.executable for c in checks.values())  # no .venv path: system python3 works
    toy = checks["toy"].command
    assert (
        "--nproc-per-node=4" in toy
        and toy[toy.index("--backend") + 1] == "nccl"
        and toy[toy.index("--steps") + 1] == "200"
    )
    cifar = {name: c.command for name, c in checks.items() if name.startswith("cifar10")}
    for name, command in cifar.items():
        batch = "1024" if "sync-bn" in name else name.split()[-1]
        assert command[command.index("--batch-size") + 1] == batch and command[command.index("--epochs") + 1] == "5"
        assert {"--amp", "--no-verify", "--data-dir"} <= set(command)
        mode = name.split()[2]
        assert ("--compile" in command) == (mode == "compile") and ("--cuda-graphs" in command) == (mode == "graphs")
    impls = {name: command[command.index("--sync-bn-impl") + 1] for name, command in cifar.items()}
    assert impls == {
        **{name: "auto" for name in MATRIX},
        "cifar10 resnet18 eager sync-bn=global": "global",
        "cifar10 resnet18 compile sync-bn=torch": "torch",
    }
    run_dirs = [command[command.index("--run-dir") + 1] for command in cifar.values()]
    assert len(set(run_dirs)) == len(cifar) == 11
    # tests/gpu only: collecting the whole tree would need the dev requirements a GPU box's own python lacks
    assert checks["pytest -m gpu"].command[1:] == ["-m", "pytest", "tests/gpu", "-m", "gpu", "-q"]
    overhead = checks["bench.ddp_overhead"].command
    assert overhead[overhead.index("--nproc") + 1] == "4"  # every GPU: nccl, since each process gets its own


@pytest.mark.parametrize(
    ("only", "chosen"),
    [
        ("", None),
        ("toy", ["toy"]),
        ("toy, pytest", ["toy", "pytest -m gpu"]),
        ("1024", [name for name in MATRIX if name.endswith("1024")]),
        ("eager batch 512,,", ["cifar10 resnet18 eager batch 512"]),
    ],
)
def test_only_runs_the_checks_whose_name_holds_one_of_its_words(tmp_path, only, chosen):
    checks = plan(gpu_sizes(1), tmp_path)
    assert [c.name for c in select(checks, only)] == (chosen if chosen is not None else [c.name for c in checks])


def test_only_with_no_match_is_one_line_naming_the_checks(tmp_path):
    with pytest.raises(
        gpu_check.ConfigError, match=r"--only 'tyo' matches no check: use words from their names \(toy, collectives"
    ):
        select(plan(gpu_sizes(1), tmp_path), "tyo")


def test_one_gpu_skips_the_sync_batchnorm_comparison_and_the_ddp_overhead(tmp_path):
    skipped = {c.name for c in plan(gpu_sizes(1), tmp_path) if c.skip}
    assert skipped == {
        "cifar10 resnet18 eager sync-bn=global",
        "cifar10 resnet18 compile sync-bn=torch",
        "bench.ddp_overhead",
    }


def test_the_cpu_plan_is_a_small_gloo_run_eager_only(tmp_path):
    checks = {c.name: c for c in plan(cpu_sizes(), tmp_path)}
    ran = {name for name, c in checks.items() if name.startswith("cifar10") and not c.skip}
    assert ran == {"cifar10 small eager batch 32", "cifar10 small eager batch 64"}
    assert "--cuda-graphs" in checks["cifar10 small graphs batch 64"].skip
    eager = checks["cifar10 small eager batch 64"].command
    assert "--no-amp" in eager and eager[eager.index("--backend") + 1] == "gloo" and "--nproc-per-node=2" in eager


def row(name: str, status: str, epochs: list[float]) -> Row:
    return Row(name, status, "", 1.0, details={"epoch_images_per_s": epochs})


def test_the_step_matrix_sets_the_modes_side_by_side_with_their_mfu():
    rows = [
        row("cifar10 resnet18 eager batch 512", PASS, [30_000.0, 42_000.0, 41_000.0]),
        row("cifar10 resnet18 compile batch 512", PASS, [10_000.0, 80_000.0]),
        row("cifar10 resnet18 graphs batch 512", FAIL, []),
        row("cifar10 resnet18 eager batch 1024", SKIP, []),
    ]
    flops = training_flops_per_image("resnet18")
    assert 3.2e9 < flops < 3.5e9  # ResNet-18 for CIFAR: about 0.56 GMAC forward, twice that backward
    lines = step_matrix(rows, "resnet18", (512, 1024), flops, peak_flops("NVIDIA H100 80GB HBM3"), gpus=2)
    assert lines[0] == "| batch per process | eager | compile | graphs |"
    eager_mfu = round(42_000 * flops / (2 * 989e12) * 100)
    assert (
        lines[2] == f"| 512 | 42,000 img/s, MFU {eager_mfu}% | "
        f"80,000 img/s, MFU {round(80_000 * flops / (2 * 989e12) * 100)}% | fail |"
    )
    assert lines[3] == "| 1024 | skip | - | - |"
    assert step_matrix(rows[:1], "resnet18", (512,), flops, peak_flops("Some CPU"), gpus=0)[2].startswith(
        "| 512 | 42,000 img/s, MFU n/a |"
    )


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("NVIDIA GeForce RTX 3060", None),
    ],
)
def test_each_gpu_gets_its_own_peak(name, tflops):
    assert peak_flops(name) == (tflops * 1e12 if tflops else None)


# ------------------------------------------------------------------------------------------ no CUDA


def test_without_cuda_it_prints_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a GPU box
    result = subprocess.run(  # forked from the suite's server, torch imported already (tests/prefork.py)
        [prefork.python(), "-m", "bench.gpu_check", "--out", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1 and "no CUDA" in result.stdout
    assert not (tmp_path / "out").exists()


def test_an_out_folder_with_a_result_is_refused(tmp_path, monkeypatch):
    (tmp_path / "results.json").write_text("{}")
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--allow-cpu", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
