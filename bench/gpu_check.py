"""`make gpu-check` (`python -m bench.gpu_check`): what a GPU box runs first, summed up in one table.

Without CUDA it says so in one line and exits 0. With CUDA, each check runs as a subprocess with a time
limit, on every GPU of this machine:

    toy            torchrun -m experiments.toy --steps 200, nccl              final loss
    collectives    torchrun -m experiments.collectives, nccl                  demos ok
    cifar10 x9     torchrun -m experiments.cifar10: ResNet-18, bf16 + channels_last, 5 epochs on a synthetic set
                   in the official format; eager, --compile and --cuda-graphs, each at batch 256, 512
                   and 1024 per process                       images/s, MFU, accuracy, peak memory
    cifar10 x2     at batch 1024, the other synchronized batch norm than --sync-bn-impl auto picks
                   (eager: GlobalBatchNorm, compiled: torch's SyncBatchNorm); 2+ GPUs only, since one
                   process synchronizes nothing                               images/s, to compare
    profile        cifar10 at the largest batch with --profile over 5 steps of its second epoch: each
                   rank's trace and memory snapshot in its run directory      the top operation; the GPU's
                   busy share and what the host ran while it waited (bench.gpu_gaps)
    bench.*        five benchmarks of `python -m bench`, one row each        their ratios
                   (bench.step_overhead: the experiment against a bare loop on one GPU, every mode, batch 1024)
                   (bench.ddp_overhead across every GPU, batch 256; 2+ GPUs only)
    pytest -m gpu  the tests that need CUDA                                   passed/failed

then prints the table and, side by side, the step matrix (images/s and model FLOP utilisation of each
mode at each batch), writes them to --out (results.json, results.md) beside each check's full output
(logs/) and run directory, and exits 1 if any check failed. Subprocesses use this interpreter, so any
python with the runtime requirements (torch, torchvision, tensorboard, python-dotenv; pytest for the gpu
tests' row) runs it without .venv: `python3 -m bench.gpu_check`.

--allow-cpu runs the same orchestration on CPU with tiny sizes (gloo, 2 processes, the small CNN, eager
only), to test gpu-check itself on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from bench.gpu_report import (
    FAIL,
    MODE_NAMES,
    PASS,
    SKIP,
    Reading,
    Row,
    cifar_name,
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
from bench.processes import child_env, run_in_own_session
from ddp_core.config import option
from ddp_core.errors import ConfigError
from ddp_core.layout import STAMP
from ddp_core.process.entry import command_main

REPO = Path(__file__).resolve().parents[1]
# Set by a launcher or a .env for another job; a check must start from a clean slate.
# How the training step runs: the flags each mode adds to the experiment's own command line.
MODES = dict(zip(MODE_NAMES, ((), ("--compile",), ("--cuda-graphs",))))
STOP_GRACE_S = 30  # torchrun needs a moment to stop its workers after SIGTERM


@dataclass
class GpuCheckArgs:
    out: str = option(
        "",
        "folder for results.json, results.md, logs/ and the run directories (default runs/gpu-check/<UTC timestamp>)",
    )
    allow_cpu: bool = option(
        False, "without CUDA, run the same checks on CPU with tiny sizes (to test gpu-check itself)"
    )
    only: str = option(
        "", "run only the checks whose name contains one of these comma-separated words (e.g. 'toy,pytest')"
    )


@dataclass(frozen=True)
class Sizes:
    """How big each check is: the real thing on GPUs, a smoke test of the orchestration on CPU."""

    nproc: int
    backend: str
    toy_steps: int
    model: str
    epochs: int
    batches: tuple[int, ...]  # per process; every mode runs at each, the sync-bn comparison at the last
    train_images: int
    test_images: int
    amp: bool
    compile: bool  # --compile and --cuda-graphs rows run (CUDA only)
    bench_args: dict[str, tuple[str, ...]]


def gpu_sizes(gpus: int) -> Sizes:
    # Eager ResNet-18 waits on the CPU's kernel launches below 1024 per process on an H100 (42k against 59k
    # images/s at 512 and 1024; docs/benchmarks.md): the matrix shows where compile and CUDA graphs lift that.
    return Sizes(
        nproc=gpus,
        backend="nccl",
        toy_steps=200,
        model="resnet18",
        epochs=5,  # the first is the warm-up: 4 steady epochs of 49 steps at 1024
        batches=(256, 512, 1024),
        train_images=50_000,
        test_images=10_000,
        amp=True,
        compile=True,
        bench_args={
            "bench.ddp": (),
            "bench.cifar10_pipeline": (),
            "bench.model_speed": (),
            # every GPU in one nccl group; a batch a GPU trains at (32 would time kernel launches)
            "bench.ddp_overhead": ("--nproc", str(gpus), "--batch-size", "256", "--rounds", "5", "--steps", "3"),
            # one process, batch 1024, every mode: 3 alternating passes of (a)-(c), the run's 3 epochs after its warm-up
            "bench.step_overhead": ("--runs", "1", "--epochs", "4"),
        },
    )


def cpu_sizes() -> Sizes:
    return Sizes(
        nproc=2,
        backend="gloo",
        toy_steps=20,
        model="small",
        epochs=1,
        batches=(32, 64),
        train_images=1024,
        test_images=256,
        amp=False,
        compile=False,
        bench_args={
            "bench.ddp": ("--rounds", "2", "--calls", "3"),
            "bench.cifar10_pipeline": ("--images", "512", "--batch-size", "128", "--rounds", "1"),
            "bench.model_speed": ("--batch-size", "8", "--rounds", "1", "--steps", "1"),
            "bench.step_overhead": ("--repeats", "1", "--runs", "1", "--train-images", "256", "--batch-size", "32"),
            "bench.ddp_overhead": (
                "--models",
                "small",
                "--batch-size",
                "8",
                "--bucket-mb",
                "25",
                "--grad-accum",
                "2",
                "--rounds",
                "1",
            ),
        },
    )


@dataclass(frozen=True)
class Check:
    name: str
    command: list[str]
    timeout_s: float
    read: Callable[[int, str], Reading]  # (exit code, output) -> what the output says
    prepare: Callable[[], None] | None = None
    skip: str = ""  # why it does not run here; empty: it runs


def torchrun(nproc: int, module: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def plan(sizes: Sizes, out: Path) -> list[Check]:
    """Every check, in the order they run."""
    data_dir = out / "data"
    prepare = partial(write_synthetic_cifar10, data_dir, sizes.train_images, sizes.test_images)
    backend = ("--backend", sizes.backend)
    checks = [
        Check(
            "toy",
            torchrun(
                sizes.nproc, "experiments.toy", "--steps", str(sizes.toy_steps), *backend, "--run-dir", str(out / "toy")
            ),
            300,
            lambda rc, output: read_toy(out / "toy"),
        ),
        Check(
            "collectives",
            torchrun(sizes.nproc, "experiments.collectives", *backend),
            300,
            lambda rc, output: read_collectives(output),
        ),
    ]
    # auto's synchronized batch norm in every mode at every batch; then, at the largest batch, the other one.
    runs = [(mode, batch, "auto") for batch in sizes.batches for mode in MODES]
    runs += [("eager", sizes.batches[-1], "global"), ("compile", sizes.batches[-1], "torch")]
    for mode, batch, sync_bn in runs:
        suffix = f"-b{batch}" if sync_bn == "auto" else f"-{sync_bn}-bn"
        run_dir = out / f"cifar10-{mode}{suffix}"
        cifar_args = [
            "--model",
            sizes.model,
            "--batch-size",
            str(batch),
            "--epochs",
            str(sizes.epochs),
            *backend,
            "--data-dir",
            str(data_dir),
            "--no-verify",
            "--run-dir",
            str(run_dir),
            "--sync-bn-impl",
            sync_bn,
        ]
        cifar_args += ["--amp"] if sizes.amp else ["--no-amp"]
        cifar_args += MODES[mode]
        checks.append(
            Check(
                cifar_name(sizes.model, mode, batch)
                if sync_bn == "auto"
                else f"cifar10 {sizes.model} {mode} sync-bn={sync_bn}",
                torchrun(sizes.nproc, "experiments.cifar10", *cifar_args),
                1200 if MODES[mode] else 900,
                lambda rc, output, run_dir=run_dir: read_cifar(
                    output, run_dir, sizes.nproc if sizes.backend == "nccl" else 0
                ),
                prepare=prepare,
                skip=_cifar_skip(sizes, mode, sync_bn),
            )
        )
    # one profiled window after the warm-up epoch, at the largest batch: where a step's time goes, by operation
    profile_dir = out / f"cifar10-profile-b{sizes.batches[-1]}"
    steps_per_epoch = sizes.train_images // (sizes.nproc * sizes.batches[-1])
    window = f"{steps_per_epoch + 2}:{max(1, min(5, steps_per_epoch - 2))}"  # the second epoch, past its first step
    profile_args = ["--model", sizes.model, "--batch-size", str(sizes.batches[-1]), "--epochs", "2", *backend]
    profile_args += ["--data-dir", str(data_dir), "--no-verify", "--run-dir", str(profile_dir), "--profile", window]
    profile_args += ["--amp"] if sizes.amp else ["--no-amp"]
    checks.append(
        Check(
            f"profile cifar10 {sizes.model}",
            torchrun(sizes.nproc, "experiments.cifar10", *profile_args),
            900,
            lambda rc, output: read_profile(output),
            prepare=prepare,
        )
    )
    readers = {
        "bench.ddp": read_bench_ddp,
        "bench.cifar10_pipeline": read_bench_pipeline,
        "bench.model_speed": read_bench_models,
        "bench.ddp_overhead": read_bench_ddp_overhead,
        "bench.step_overhead": read_bench_step_overhead,
    }
    for module, reader in readers.items():
        checks.append(
            Check(
                module,
                [sys.executable, "-m", module, *sizes.bench_args[module]],
                1200 if module == "bench.step_overhead" else 600,  # compiles ResNet-18 for each mode's rows
                lambda rc, output, reader=reader: reader(output),
                skip=_bench_skip(sizes, module),
            )
        )
    checks.append(
        Check("pytest -m gpu", [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q"], 900, read_pytest)
    )
    return checks


def select(checks: list[Check], only: str) -> list[Check]:
    """The checks whose name contains one of ``only``'s comma-separated words; all of them when it is empty."""
    words = [word.strip() for word in only.split(",") if word.strip()]
    if not words:
        return checks
    chosen = [check for check in checks if any(word in check.name for word in words)]
    if not chosen:
        names = ", ".join(check.name for check in checks)
        raise ConfigError(f"--only {only!r} matches no check: use words from their names ({names})")
    return chosen


def _cifar_skip(sizes: Sizes, mode: str, sync_bn: str) -> str:
    """Why a CIFAR10 row does not run here; empty when it does."""
    if MODES[mode] and not sizes.compile:
        return f"no {' '.join(MODES[mode])} in a CPU smoke run"
    if sync_bn != "auto" and sizes.backend != "nccl":
        return "compares the two synchronized batch norms on GPUs (torch's refuses CPU tensors)"
    if sync_bn != "auto" and sizes.nproc < 2:
        return "one GPU: batch norm is not synchronized, both would measure the same"
    return ""


def _bench_skip(sizes: Sizes, module: str) -> str:
    if module == "bench.ddp_overhead" and sizes.backend == "nccl" and sizes.nproc < 2:
        return "one GPU: no gradient all-reduce between GPUs to measure (make bench measures it on CPU)"
    return ""


def write_synthetic_cifar10(root: Path, train_images: int, test_images: int) -> None:
    """A learnable synthetic set in the official on-disk format, the real set's size on GPUs; once per --out."""
    from experiments import cifar10_data as data  # here: only the CIFAR checks need it

    if (data.dataset_folder(root) / data.TEST_FILES[0]).is_file():
        return
    chunk = 10_000  # bounded memory: the generator holds float64 noise for every image it makes
    parts = [
        data.make_learnable_images(min(chunk, train_images - start), seed=start // chunk)
        for start in range(0, train_images, chunk)
    ]
    train = data.Split(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]))
    test = data.make_learnable_images(test_images, seed=1_000_000)
    data.write_cifar10_format(root, train.images, train.labels, test.images, test.labels)


# ------------------------------------------------------------------------------------------ running


@dataclass
class Finished:
    returncode: int
    output: str
    seconds: float
    timed_out: bool


def run_command(command: list[str], timeout_s: float, log_path: Path) -> Finished:
    """Run from the repository root, stdout and stderr into ``log_path`` (kept: the table shows one line)."""
    started = time.perf_counter()
    code, timed_out = run_in_own_session(command, REPO, child_env(), log_path, timeout_s, STOP_GRACE_S)
    output = log_path.read_text(errors="replace")
    return Finished(code if code is not None else -9, output, time.perf_counter() - started, timed_out)


def judge(check: Check, finished: Finished) -> Row:
    """A SKIP from the reader wins; then a non-zero exit (with its last error line); then the reader's FAIL."""
    reading = check.read(finished.returncode, finished.output)
    row = Row(check.name, PASS, reading.figure, finished.seconds, details=reading.details)
    if reading.status == SKIP:
        row.status = SKIP
    elif finished.timed_out:
        row.status, row.error = (
            FAIL,
            f"timed out after {check.timeout_s:.0f} s; last line: {last_error_line(finished.output)}",
        )
    elif finished.returncode != 0:
        row.status, row.error = FAIL, f"exit {finished.returncode}: {last_error_line(finished.output)}"
    elif reading.status == FAIL:
        row.status, row.error = FAIL, reading.error
    return row


def run_check(check: Check, logs: Path) -> Row:
    if check.skip:
        return Row(check.name, SKIP, check.skip, 0.0)
    started = time.perf_counter()
    if check.prepare is not None:
        try:
            check.prepare()
        except Exception as error:  # a broken data folder fails this check, not the whole table
            return Row(
                check.name, FAIL, "", time.perf_counter() - started, error=f"preparing: {type(error).__name__}: {error}"
            )
    log_path = logs / (check.name.replace(" ", "_").replace("-", "") + ".log")
    return judge(check, run_command(check.command, check.timeout_s, log_path))


# ------------------------------------------------------------------------------------------ context


def training_flops_per_image(model_name: str) -> float:
    """FLOPs of one training image through the model, forward and backward, counted by torch on CPU (two
    images, so batch norm trains as it does): the numerator of the step matrix's MFU."""
    from torch.utils.flop_counter import FlopCounterMode

    from experiments.cifar10_models import build_model  # here: only the matrix needs it

    model, images = build_model(model_name, num_classes=10), torch.randn(2, 3, 32, 32)
    with FlopCounterMode(display=False) as counter:
        model(images).sum().backward()
    return counter.get_total_flops() / len(images)


def machine_context(sizes: Sizes) -> tuple[str, list[str], dict[str, object]]:
    """(title, markdown lines, JSON fields) naming the machine and software; read after the checks (the
    first CUDA query creates a context on GPU 0 that the checks should not share)."""
    if sizes.backend == "nccl":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        hardware = f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        names, hardware = [], f"CPU only ({os.cpu_count()} cores), --allow-cpu smoke run"
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    fields: dict[str, object] = {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hardware": hardware,
        "gpus": names,
        "processes": sizes.nproc,
        "backend": sizes.backend,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "commit": commit + (" (dirty)" if dirty and commit else ""),
    }
    title = f"gpu-check {fields['utc'][:10]}: {hardware}"
    lines = [
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {fields['python']}, {sizes.nproc} process(es), "
        f"{sizes.backend}; commit {fields['commit'] or 'unknown'}. "
        "Command: `make gpu-check` (`python -m bench.gpu_check`)."
    ]
    return title, lines, fields


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ------------------------------------------------------------------------------------------ main


def default_out() -> Path:
    return Path("runs") / "gpu-check" / time.strftime(STAMP, time.gmtime())


def run_bench(args: GpuCheckArgs) -> int:
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"gpu-check: no CUDA GPU visible to torch {torch.__version__} on this machine: "
            "nothing to check (see --help for --allow-cpu)"
        )
        return 0
    sizes = gpu_sizes(torch.cuda.device_count()) if torch.cuda.is_available() else cpu_sizes()
    out = Path(args.out or default_out()).resolve()
    if (out / "results.json").exists():
        raise ConfigError(f"{out} already holds a gpu-check result: choose another --out")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    rows = []
    checks = select(plan(sizes, out), args.only)
    for number, check in enumerate(checks, start=1):
        print(f"[{number}/{len(checks)}] {check.name} ...", file=sys.stderr, flush=True)
        rows.append(run_check(check, logs))
        # Each row as it ends, on the console and in rows.jsonl: a run stopped part-way keeps what it measured.
        print(render_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        with (out / "rows.jsonl").open("a") as partial:
            partial.write(json.dumps(dataclasses.asdict(rows[-1]), default=str) + "\n")

    title, context, fields = machine_context(sizes)
    names = fields["gpus"]
    flops = training_flops_per_image(sizes.model)
    matrix = step_matrix(rows, sizes.model, sizes.batches, flops, peak_flops(names[0]) if names else None, len(names))
    matrix_text = "\n".join(
        [
            f"The training step, side by side: best epoch's images/s (all processes) and MFU ({flops / 1e9:.2f} GFLOP "
            f"per image, forward and backward; peak: dense bf16 of {names[0] if names else 'no GPU'})",
            "",
            *matrix,
        ]
    )
    (out / "results.json").write_text(
        json.dumps(
            {
                "title": title,
                **fields,
                "training_flops_per_image": flops,
                "step_matrix": matrix,
                "rows": [dataclasses.asdict(r) for r in rows],
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    (out / "results.md").write_text(render_markdown(rows, title, context) + "\n" + matrix_text + "\n")
    print(
        f"\n{title}\n{context[0]}\n\n{render_table(rows)}\n\n{matrix_text}\n\n"
        f"full output: {logs}/; table: {out / 'results.md'}"
    )
    return 1 if any(row.status == FAIL for row in rows) else 0


main = command_main(GpuCheckArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
