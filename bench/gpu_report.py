"""What `make gpu-check` reads out of each check's output, and the one table it prints.

Pure functions of strings and files, so they are tested on canned output on a machine without a GPU
(tests/unit/test_gpu_check.py). The orchestration is in ``bench.gpu_check``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import gpu_gaps
from ddp_core.layout import METRICS

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
GOAL_IMAGES_PER_S = 50_000  # the goal: ResNet-18 trains at 50,000 images/s or more on one H100
PYTEST_NO_TESTS_COLLECTED = 5


@dataclass
class Reading:
    """What a check's output says. A non-zero exit code is a FAIL whatever the reading, except a SKIP;
    ``status`` FAIL here flags a run that exited 0 but lacks what it should have produced."""

    figure: str = ""
    status: str | None = None
    error: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    name: str
    status: str
    figure: str
    seconds: float
    error: str = ""
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ errors

# torchrun's failure summary surrounds the worker's real error with lines that never say what went wrong.
_BOILERPLATE = re.compile(
    r"error_file|ChildFailedError|To enable traceback|Root Cause|Failures:|^\S+ FAILED$|failed \(exitcode"
)
_ERRORISH = re.compile(
    r"(?i)\b\w*(error|exception)\b|\bfailed\b|Killed|Segmentation fault|out of memory|Signal \d+ \(SIG"
)
_PYTEST_FAILURE = re.compile(r"^(FAILED|ERROR) \S+")  # pytest -ra's short summary: test id and message
_TORCHRUN_EXIT = re.compile(r"failed \(exitcode: -?\d+\)")  # names the exit code when nothing else does


def last_error_line(output: str, width: int = 200) -> str:
    """The line that best says why a command failed: a pytest failure; else the last error-looking line (a
    worker's exception, not torchrun's summary around it); else torchrun's exit code line; else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    tiers = (
        lambda line: _PYTEST_FAILURE.match(line),
        lambda line: _ERRORISH.search(line) and not _BOILERPLATE.search(line),
        lambda line: _TORCHRUN_EXIT.search(line),
        lambda line: True,
    )
    line = next((found[-1] for tier in tiers if (found := [x for x in lines if tier(x)])), "(no output)")
    return line if len(line) <= width else line[: width - 3] + "..."


# ----------------------------------------------------------------------------------------- readers


def read_metrics(run_dir: Path) -> dict[str, Any]:
    """The run's metrics.json (rank 0 writes it when the run succeeds), or {} when there is none."""
    try:
        return json.loads((run_dir / METRICS).read_text())
    except (OSError, ValueError):
        return {}


def read_toy(run_dir: Path) -> Reading:
    metrics = read_metrics(run_dir)
    loss = metrics.get("final_loss")
    if not isinstance(loss, (int, float)):
        return Reading(status=FAIL, error=f"no final_loss in {run_dir / METRICS}", details=metrics)
    if not math.isfinite(loss):
        return Reading(figure=f"final loss {loss}", status=FAIL, error="the final loss is not finite", details=metrics)
    return Reading(figure=f"final loss {loss:.4f}", details=metrics)


def read_collectives(output: str) -> Reading:
    """Counts the outcomes in the demo's closing ``Summary:`` block (one ``  name  outcome`` line per demo)."""
    _, found, summary = output.rpartition("\nSummary:\n")
    if not found:
        return Reading(status=FAIL, error="no Summary: block in the output")
    outcomes = {}
    for line in summary.splitlines():
        match = re.match(r"^  (\w+)\s+(\S.*)$", line)
        if not match:
            break  # the block ends at the first line that is not a demo's
        outcomes[match[1]] = match[2].strip()
    ok = sum(outcome == "ok" for outcome in outcomes.values())
    failed = [name for name, outcome in outcomes.items() if outcome.startswith("FAILED")]
    others = len(outcomes) - ok - len(failed)
    figure = f"{ok}/{len(outcomes)} demos ok" + (f", {others} unsupported" if others else "")
    if failed:
        return Reading(figure=figure, status=FAIL, error=f"{failed[0]}: {outcomes[failed[0]]}", details=outcomes)
    if not outcomes:
        return Reading(status=FAIL, error="an empty Summary: block")
    return Reading(figure=figure, details=outcomes)


_EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+)\s+step \d+\s+eval accuracy ([\d.]+).*?\s([\d.]+) images/s")


def epoch_images_per_s(output: str) -> list[float]:
    """Training images/s of each epoch, in order, from the experiment's ``epoch N/M ... X images/s`` lines."""
    return [float(match[4]) for match in _EPOCH_LINE.finditer(output)]


def read_cifar(output: str, run_dir: Path, gpus: int) -> Reading:
    """images/s: best and last epoch (the first is the warm-up: compilation, the first pass) and metrics.json's
    steady state (the epochs after the warm-up, training steps only)."""
    metrics = read_metrics(run_dir)
    epochs = epoch_images_per_s(output)
    peak = metrics.get("peak_gpu_memory_gib")  # rank 0's, written by the experiment on CUDA
    details = {"epoch_images_per_s": epochs, "peak_memory_gib": peak, "gpus": gpus, **metrics}
    if not epochs:
        return Reading(status=FAIL, error="no 'epoch N/M ... images/s' lines in the output", details=details)
    best = max(epochs)
    parts = [f"best epoch {best:,.0f} img/s"]
    if gpus > 1:
        parts[0] += f" ({best / gpus:,.0f}/GPU)"
    if gpus:
        parts[0] += f" (goal {GOAL_IMAGES_PER_S:,}/H100)"
    parts.append(f"last {epochs[-1]:,.0f}")
    if "images_per_s" in metrics:
        parts.append(f"steady {metrics['images_per_s']:,.0f}")
    if "eval_accuracy" in metrics:
        parts.append(f"acc {metrics['eval_accuracy']:.3f}")
    if "amp" in metrics:  # what --amp-dtype auto chose: bf16, or fp16 + GradScaler on a GPU without bf16
        parts.append(f"amp {metrics['amp']}")
    parts.append(f"peak mem {peak:.1f} GiB" if peak is not None else "peak mem n/a")
    return Reading(figure="; ".join(parts), details=details)


def _no_figures(what: str) -> Reading:
    return Reading(status=FAIL, error=f"{what} not found in the output (did its format change?)")


def _first_number(pattern: str, output: str) -> float | None:
    match = re.search(pattern, output)
    return float(match[1].replace(",", "")) if match else None


def read_bench_ddp(output: str) -> Reading:
    header = re.search(r"ddp-lab benchmarks: .*?, (\d+) processes, (\w+), (\w+)", output)
    ratio = _first_number(r"DDP step = ([\d.]+)x the local step", output)
    loop = _first_number(r"loop of \d+ all_gather\s+[\d.]+ ms\s+([\d.]+)x", output)
    if header is None or ratio is None:
        return _no_figures("the DDP step ratio")
    where = f"{header[1]} procs, {header[2]}/{header[3]}"
    figure = f"{where}: DDP step {ratio:.1f}x the no-comm step"
    if loop is not None:
        figure += f"; loop of all_gather {loop:.1f}x one collective"
    return Reading(
        figure=figure, details={"ddp_over_local_step": ratio, "loop_over_one_collective": loop, "backend": header[2]}
    )


def read_bench_ddp_overhead(output: str) -> Reading:
    """Each model's DDP ÷ no-comm ratio at DDP's default bucket size, and with gradient accumulation."""
    header = re.search(r"no gradient all-reduce\): (\d+) processes, (\w+) on (\w+)", output)
    rows = re.findall(r"^\| (\w+) \([\d.]+ MB of gradients\) \| ([^|]+?) \|.*\| ([\d.]+)× \|$", output, re.M)
    if header is None or not rows:
        return _no_figures("the DDP-overhead table")
    ratios = {f"{model}, {variant}": float(ratio) for model, variant, ratio in rows}
    default = {model: float(ratio) for model, variant, ratio in rows if variant == "bucket 25 MB (default)"}
    accum = {model: float(ratio) for model, variant, ratio in rows if "grad accum" in variant}
    figure = f"{header[1]} procs, {header[2]}/{header[3]}: DDP ÷ no-comm " + ", ".join(
        f"{model} {ratio:.2f}x" + (f" ({accum[model]:.2f}x with grad accum)" if model in accum else "")
        for model, ratio in default.items()
    )
    return Reading(figure=figure, details={"backend": header[2], **ratios})


def read_bench_pipeline(output: str) -> Reading:
    tensor = _first_number(r"tensor \(resident, batched ops\)\s+([\d,]+) images/s", output)
    ratio = _first_number(r"tensor / torchvision: ([\d.]+)x", output)
    if tensor is None or ratio is None:
        return _no_figures("the pipelines' images/s")
    return Reading(
        figure=f"CPU: tensor pipeline {tensor:,.0f} img/s, {ratio:.1f}x torchvision",
        details={"tensor_images_per_s": tensor, "ratio": ratio},
    )


def read_bench_models(output: str) -> Reading:
    rates = {
        match[1]: float(match[2])
        for match in re.finditer(r"^\s+(\w+)\s+[\d.]+ M parameters .*?([\d.]+) images/s", output, re.M)
    }
    if not rates:
        return _no_figures("the models' images/s")
    return Reading(
        figure="CPU, 1 thread: " + ", ".join(f"{name} {rate:,.0f} img/s" for name, rate in rates.items()), details=rates
    )


# name, images/s, its min-max, n, the paired ratio to (a), the pairs' min-max, the ratio to the best bare mode
_OVERHEAD_ROW = re.compile(
    r"^(eager|compile|cuda-graphs) \(([abcd])\) .*?([\d,]+)\s+[\d,]+-[\d,]+\s+\d+"
    r"\s+([\d.]+)\s+[\d.]+-[\d.]+\s+([\d.]+)$",
    re.M,
)


def read_bench_step_overhead(output: str) -> Reading:
    """bench.step_overhead's table: the experiment (d) over the bare step (a), per mode and over the best bare mode."""
    rows = {
        (m[1], m[2]): (float(m[3].replace(",", "")), float(m[4]), float(m[5])) for m in _OVERHEAD_ROW.finditer(output)
    }
    runs = {mode: row for (mode, letter), row in rows.items() if letter == "d"}
    if not runs:
        return _no_figures("the experiment's row (d)")
    best_mode = max(runs, key=lambda mode: runs[mode][0])
    parts = [f"(d)/(a) {mode} {ratio:.2f}" for mode, (_, ratio, _) in runs.items()]
    parts.append(f"best (d) {best_mode} {runs[best_mode][0]:,.0f} img/s = {runs[best_mode][2]:.2f} of the best bare")
    details = {
        f"{mode} ({letter})": {"images_per_s": r[0], "ratio": r[1], "ratio_to_best_bare": r[2]}
        for (mode, letter), r in rows.items()
    }
    return Reading(figure="; ".join(parts), details=details)


_PROFILE_LINE = re.compile(
    r"profile of steps (\S+) on rank (\d+): (\S+) \(Perfetto opens it\); its top \d+ operations by (.+?):"
)


def read_profile(output: str) -> Reading:
    """A --profile run: each rank's trace written, and the operation that took the most time in the window."""
    found = _PROFILE_LINE.findall(output)
    if not found:
        return _no_figures("the profile's summary line")
    missing = [path for _, _, path, _ in found if not Path(path).is_file()]
    if missing:
        return Reading(status=FAIL, error=f"the trace {missing[0]} was announced but not written")
    steps, _, path, by = found[0]
    table = output[output.index(path) :].splitlines()[4:5]  # the summary's first operation, after its header
    top = re.split(r"\s{2,}", table[0].strip())[:3] if table else []
    figure = f"steps {steps}, {len(found)} rank(s); top by {by}: {' '.join(top) if top else 'n/a'}"
    details: dict[str, Any] = {"traces": [row[2] for row in found], "top": top}
    waits = _gpu_waits(path)
    if waits is not None:  # a trace with GPU work: how busy the GPU was, and what the host did while it waited
        figure += f"; GPU busy {waits.busy_us / waits.window_us:.0%}"
        host = max(waits.during.items(), key=lambda item: item[1], default=None)
        if host is not None:
            figure += f", waiting most while the host ran {host[0]}"
        details.update(gpu_busy=round(waits.busy_us / waits.window_us, 4), gpu_waited_for=dict(waits.during))
    return Reading(figure=f"{figure}; {path}", details=details)


def _gpu_waits(path: str) -> gpu_gaps.Gaps | None:
    """bench.gpu_gaps on rank 0's trace; None for a trace without GPU work (a CPU run) or one that cannot be read."""
    try:
        found = gpu_gaps.gaps(gpu_gaps.load(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if found.window_us else None


def read_pytest(returncode: int, output: str) -> Reading:
    """Exit code 5 (nothing selected) is "no gpu tests yet"; a run whose tests all skipped is a SKIP."""
    if returncode == PYTEST_NO_TESTS_COLLECTED:
        return Reading(figure="no gpu tests yet", status=SKIP)
    if "No module named pytest" in output:
        return Reading(figure="pytest is not installed for this python", status=SKIP)
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    if not summary:
        return _no_figures("pytest's summary line")
    counts = {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary[-1])
    }
    figure = ", ".join(f"{n} {word}" for word, n in counts.items())
    if returncode == 0 and not counts.get("passed"):
        skip_reason = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.+)", output)
        return Reading(figure=figure + (f" ({skip_reason[1]})" if skip_reason else ""), status=SKIP, details=counts)
    return Reading(figure=figure, details=counts)


# ------------------------------------------------------------------------------------------- table

HEADERS = ("check", "status", "figure", "seconds", "error (FAIL only)")


# Dense bf16 tensor-core peak of one GPU, TFLOP/s (the vendors' data sheets), by a part of the name torch
# reports; the first match wins, so the specific names come before the family's.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
MODE_NAMES = ("eager", "compile", "graphs")


def peak_flops(device_name: str) -> float | None:
    """One GPU's dense bf16 peak in FLOP/s, or None for a device not in PEAK_BF16_TFLOPS."""
    return next((tflops * 1e12 for part, tflops in PEAK_BF16_TFLOPS if part in device_name), None)


def cifar_name(model: str, mode: str, batch: int) -> str:
    """The name of the CIFAR10 check for one mode at one batch per process (the step matrix reads them)."""
    return f"cifar10 {model} {mode} batch {batch}"


def step_matrix(
    rows: list[Row], model: str, batches: tuple[int, ...], flops_per_image: float, peak_per_gpu: float | None, gpus: int
) -> list[str]:
    """Markdown: images/s of the best epoch and model FLOP utilisation, each mode at each batch per process.

    MFU = images/s x the model's training FLOPs per image (forward and backward) / (peak x GPUs): the share
    of the tensor cores' peak the training step uses; n/a where the peak is unknown (CPU, another GPU)."""
    by_name = {row.name: row for row in rows}
    lines = [f"| batch per process | {' | '.join(MODE_NAMES)} |", "|---:|" + "---:|" * len(MODE_NAMES)]
    for batch in batches:
        cells = []
        for mode in MODE_NAMES:
            row = by_name.get(cifar_name(model, mode, batch))
            epochs = row.details.get("epoch_images_per_s") if row is not None else None
            if row is None or row.status != PASS or not epochs:
                cells.append(row.status.lower() if row is not None else "-")
                continue
            best = max(epochs)
            mfu = f"{best * flops_per_image / (peak_per_gpu * gpus):.0%}" if peak_per_gpu and gpus else "n/a"
            cells.append(f"{best:,.0f} img/s, MFU {mfu}")
        lines.append(f"| {batch} | {' | '.join(cells)} |")
    return lines


def _cells(row: Row) -> tuple[str, ...]:
    return (row.name, row.status, row.figure or "-", f"{row.seconds:.1f}", row.error if row.status == FAIL else "")


def render_table(rows: list[Row]) -> str:
    """Fixed-width text, one line per check."""
    cells = [HEADERS, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADERS))]
    lines = [
        "  ".join(text.rjust(w) if i == 3 else text.ljust(w) for i, (text, w) in enumerate(zip(line, widths))).rstrip()
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: list[Row], title: str, context: list[str]) -> str:
    """The same table as markdown, ready to paste into docs/benchmarks.md."""
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = [f"## {title}", "", *context, "", "| " + " | ".join(HEADERS) + " |", "|---|---|---|---:|---|"]
    lines += ["| " + " | ".join(escape(cell) for cell in _cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"
