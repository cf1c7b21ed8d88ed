"""How close the CIFAR10 experiment's training step comes to a bare loop on the same model:
`python -m bench.step_overhead` (part of `make bench` on CPU, a row of `make gpu-check` on a GPU).

Four rows, each the same model, dtype, memory format, optimizer and per-process batch as the experiment's
(ResNet-18 or the small CNN of experiments/cifar10_models.py; bf16 autocast and channels_last on CUDA, float32
on CPU, as the experiment's --amp default; Nesterov SGD without weight decay on batch-norm parameters and
biases; label-smoothed cross-entropy):

    (a) bare      the step alone, on a batch already on the device
    (b) loader    (a) fed by the experiment's own input pipeline (resident uint8 data, crop, flip, normalise)
    (c) ddp       (b) with the model in DDP, a process group of one
    (d) run       the experiment itself, as `make train` runs it (ddp_core.torchrun, one process, a synthetic
                  set in the official format): the training throughput of its steady-state epochs, which
                  leaves out its warm-up epoch, evaluations and checkpoint stalls (as metrics.json does)

in each mode: eager, compile (`torch.compile`; (a)-(c) compile the whole step, (d) runs `--compile`) and cuda-graphs
(the model compiled with `mode="reduce-overhead"`, as (d)'s `--cuda-graphs`), CUDA only. Each row's figure is the
median of its samples with their min-max: (a)-(c) are timed over one pass of the training set per repeat, each row
first in turn, the modes' repeats alternating; (d)'s samples are its runs' steady-state epochs (3 a run by default).
Ratios to (a) are paired, each sample over the (a) measured beside it: (b) and (c) over the same repeat's (a) pass,
each of (d)'s epochs over the mean of the two (a) passes timed right before and right after its training steps (the
run pauses after each epoch's steps, its clock stopped, while this process times one: bench.epoch_gate;
the machine's pace moves by 10-20% over tens of seconds on a shared VM, more than the overheads measured here, so a
whole run between two passes was too loose a pair); each row's ratio is the median of its pairs, with their min-max.
Each row over the best bare mode is a ratio of medians. `--json PATH` writes the rows.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench import epoch_gate
from bench.processes import child_env, stop_group
from bench.timing import synchronize
from ddp_core.config import option, parse_args, require
from ddp_core.distributed.group import BUFFER_SYNC_OPTION
from ddp_core.errors import ConfigError
from ddp_core.process.entry import command_main
from ddp_core.training.amp import choose_amp
from ddp_core.training.optim import fused_on, weight_decay_groups
from ddp_core.training.samplers import TrainSampler
from ddp_core.training.seed import speed_switches
from experiments import cifar10_data as data
from experiments.cifar10 import Cifar10Args
from experiments.cifar10_models import MODELS, build_model

REPO = Path(__file__).resolve().parents[1]
MODES = ("eager", "compile", "cuda-graphs")
EXPERIMENT_FLAGS = {"eager": (), "compile": ("--compile",), "cuda-graphs": ("--cuda-graphs",)}
ROWS = ("bare", "loader", "ddp", "run")
IN_PROCESS = ROWS[:3]
ROW_NAMES = {"bare": "(a) bare step", "loader": "(b) + its loader", "ddp": "(c) + DDP", "run": "(d) the experiment"}
EPOCH_LINE = re.compile(r"epoch (\d+)/\d+ .*?([\d.]+) images/s")


@dataclass
class StepOverheadArgs:
    model: str = option("auto", "network (auto: resnet18 on CUDA, small on CPU)", choices=("auto", *MODELS))
    batch_size: int = option(0, "images per step (0: 1024 on CUDA, 64 on CPU)", minimum=0)
    modes: str = option("auto", "comma-separated modes: eager, compile, cuda-graphs (auto: all on CUDA, eager on CPU)")
    repeats: int = option(
        5, "timed passes of (a)-(c) per mode, each row first in turn, alternating with the other modes", minimum=1
    )
    runs: int = option(3, "runs of the experiment (d) per mode", minimum=1)
    epochs: int = option(4, "epochs of each experiment run; its first is its warm-up", minimum=2)
    train_images: int = option(0, "images in the synthetic training set (0: 50000 on CUDA, 2048 on CPU)", minimum=0)
    json: str = option("", "write the rows (name, images_per_s, ratio, ...) to this file")
    experiment_args: str = option(
        "", "more flags for (d)'s runs, to see what one costs (e.g. --experiment-args=--no-checkpoint-async)"
    )


@dataclass
class Row:
    mode: str
    row: str
    samples: list[float]
    paired: list[float] = field(default_factory=list)  # each sample's ratio to the (a) measured beside it

    @property
    def name(self) -> str:
        return f"{self.mode} {ROW_NAMES[self.row]}"

    @property
    def images_per_s(self) -> float:
        return statistics.median(self.samples)


# ---------------------------------------------------------------------------------------------------- (a)-(c)


class Step:
    """One optimizer step, as the experiment takes it: forward under autocast, loss, backward, SGD."""

    def __init__(self, model: nn.Module, device: torch.device, mode: str, channels_last: bool, autocast) -> None:
        self.model, self.autocast = model, autocast
        groups = weight_decay_groups(model, 5e-4)
        self.optimizer = torch.optim.SGD(groups, 0.1, 0.9, nesterov=True, **fused_on(device))
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.channels_last = channels_last
        self.forward: Callable[[torch.Tensor], torch.Tensor] = model
        self.run = self._step
        if mode == "compile":
            self.run = torch.compile(self._step)  # the whole step, its optimizer too
        elif mode == "cuda-graphs":
            # the model, as the experiment's --cuda-graphs: the whole step under CUDA graphs overwrote its own
            # momentum buffers with the next replay (torch 2.11: "accessing tensor output of CUDAGraphs that has
            # been overwritten")
            graphed = torch.compile(model, mode="reduce-overhead")

            def forward(images: torch.Tensor) -> torch.Tensor:
                torch.compiler.cudagraph_mark_step_begin()
                return graphed(images)

            self.forward = forward

    def _step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss = self.loss_fn(self.forward(images), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def images_per_second(step: Step, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """One pass over ``batches``, timed from its first batch's request to its last step's end on the device."""
    synchronize(device)
    began, images = time.perf_counter(), 0
    for inputs, labels in batches:
        step.run(inputs, labels)
        images += len(labels)
    synchronize(device)
    return images / (time.perf_counter() - began)


class InProcess:
    """Rows (a)-(c) of one mode: their models and batches built once, warmed up on the first call."""

    def __init__(self, args: StepOverheadArgs, mode: str, device: torch.device, split: data.Split) -> None:
        self.device = device
        amp = choose_amp(device, None, "auto")  # the experiment's default: bf16 + channels_last on CUDA only
        self.channels_last = amp.enabled
        form = torch.channels_last if amp.enabled else torch.contiguous_format
        loader = self.loader = data.train_loader(
            split,
            TrainSampler(len(split.labels), 0, 1, seed=0),
            args.batch_size,
            device=device,
            channels_last=amp.enabled,
        )
        steps = len(loader)
        torch.manual_seed(0)
        images = torch.randn(args.batch_size, 3, 32, 32, device=device).contiguous(memory_format=form)
        labels = torch.randint(0, data.NUM_CLASSES, (args.batch_size,), device=device)
        self.resident = [(images, labels)] * steps  # (a): the same batch, already on the device, every step

        def model() -> nn.Module:
            torch.manual_seed(0)
            return build_model(args.model, data.NUM_CLASSES).to(device, memory_format=form)

        device_ids = [device.index] if device.type == "cuda" else None
        # as ddp_core's wrap_ddp makes it at a world of one: no buffers broadcast to itself
        ddp = nn.parallel.DistributedDataParallel(model(), device_ids=device_ids, **{BUFFER_SYNC_OPTION: False})
        plain = Step(model(), device, mode, amp.enabled, amp.autocast)  # (a) and (b): one compilation for both
        self.steps = {"bare": plain, "loader": plain, "ddp": Step(ddp, device, mode, amp.enabled, amp.autocast)}
        self.warm = False

    def measure(self, row: str) -> float:
        if not self.warm:  # compilation, cuDNN's choices, the caching allocator: one untimed pass of each
            for name in self.steps:
                images_per_second(self.steps[name], self._batches(name), self.device)
            self.warm = True
        return images_per_second(self.steps[row], self._batches(row), self.device)

    def _batches(self, row: str) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        return self.resident if row == "bare" else self.loader


# ---------------------------------------------------------------------------------------------------- (d)


def run_experiment(
    args: StepOverheadArgs, mode: str, data_dir: Path, run_dir: Path, bare: Callable[[], float]
) -> tuple[list[float], list[tuple[float, float]]]:
    """One run of the experiment as `make train` launches it, paused after each epoch's training steps while
    ``bare`` times one pass (bench.epoch_gate). Returns its steady-state epochs' images/s and, for each,
    the bare passes timed right before and right after its steps."""
    command = [
        *(sys.executable, "-m", "ddp_core.torchrun", "--standalone", "--nproc-per-node=1"),
        *("-m", "experiments.cifar10", "--model", args.model, "--batch-size", str(args.batch_size)),
        *("--epochs", str(args.epochs), "--data-dir", str(data_dir), "--no-verify", "--run-dir", str(run_dir)),
        *EXPERIMENT_FLAGS[mode],
        *shlex.split(args.experiment_args),
    ]
    gate_path, log_path = run_dir.with_name(run_dir.name + ".gate"), run_dir.with_name(run_dir.name + ".log")
    passes = []  # one after each epoch's training steps
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gate, log_path.open("w") as log:
        gate.bind(str(gate_path))
        gate.listen(1)
        gate.settimeout(1.0)
        env = child_env(**epoch_gate.env(str(gate_path)))
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        began = time.monotonic()
        try:
            while process.poll() is None:
                if time.monotonic() - began > 1800:
                    raise RuntimeError(f"the experiment ({mode}) ran past 30 minutes: stopped")
                try:
                    worker, _ = gate.accept()
                except TimeoutError:
                    continue
                with worker:
                    worker.settimeout(60)
                    worker.recv(64)  # the epoch just trained; its figure comes in its line
                    passes.append(bare())
                    worker.sendall(b"g")
        finally:
            if process.poll() is None:  # a failed pass, a timeout or Ctrl-C: the launcher and its worker go
                stop_group(process, 5)
    output = log_path.read_text()
    if process.returncode != 0:
        last = output.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"the experiment ({mode}) failed with exit code {process.returncode}: {last[0]}")
    steady = steady_epochs(output)
    if not steady or len(passes) != len(steady) + 1:
        raise RuntimeError(
            f"the experiment ({mode}) printed {len(steady)} steady-state epoch lines and paused {len(passes)} times:"
            f" one more pause than steady epochs was expected"
        )
    return steady, [(passes[index], passes[index + 1]) for index in range(len(steady))]


def steady_epochs(output: str) -> list[float]:
    """The images/s of every epoch line but the first (the warm-up: compilation, the first pass)."""
    return [float(speed) for epoch, speed in EPOCH_LINE.findall(output) if int(epoch) > 1]


def experiment_threads() -> int:
    """Give this process the torch threads the experiment's worker starts with, and return their number.

    A fresh interpreter in the experiment's environment tells it (torch's default, or OMP_NUM_THREADS): in `make
    bench` the benchmarks before this one leave one thread set, and (a)-(c) at one thread against (d) at two read
    the experiment 1.65 times as fast as a bare step."""
    asked = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    threads = int(asked.stdout.split()[-1])
    torch.set_num_threads(threads)
    return threads


# ---------------------------------------------------------------------------------------------------- the table


def ratios(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Each row's paired ratios to (a) of its mode (median, min, max; (a) itself: 1), and its median over the best
    bare mode's."""
    best = max(row.images_per_s for row in rows if row.row == "bare")
    shares = {}
    for row in rows:
        paired = row.paired or [1.0]
        shares[row.name] = {
            "ratio": statistics.median(paired),
            "ratio_min": min(paired),
            "ratio_max": max(paired),
            "ratio_to_best_bare": row.images_per_s / best,
        }
    return shares


def render(rows: list[Row], header: str) -> str:
    shares = ratios(rows)
    lines = [
        header,
        f"{'':34s} {'images/s':>10s} {'min-max':>19s} {'n':>3s} {'÷ (a), paired':>14s} {'min-max':>13s} "
        f"{'÷ best bare':>12s}",
    ]
    for row in rows:
        spread = f"{min(row.samples):,.0f}-{max(row.samples):,.0f}"
        share = shares[row.name]
        paired = f"{share['ratio_min']:.3f}-{share['ratio_max']:.3f}"
        lines.append(
            f"{row.name:34s} {row.images_per_s:10,.0f} {spread:>19s} {len(row.samples):3d} "
            f"{share['ratio']:14.3f} {paired:>13s} {share['ratio_to_best_bare']:12.3f}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, object]]:
    shares = ratios(rows)
    return [
        {
            "name": row.name,
            "mode": row.mode,
            "row": row.row,
            "images_per_s": row.images_per_s,
            "min": min(row.samples),
            "max": max(row.samples),
            "samples": row.samples,
            "paired_ratios": row.paired,
            **shares[row.name],
        }
        for row in rows
    ]


def resolve(args: StepOverheadArgs, cuda: bool) -> list[str]:
    """Defaults by device, and the modes asked for (checked)."""
    if args.model == "auto":
        args.model = "resnet18" if cuda else "small"
    args.batch_size = args.batch_size or (1024 if cuda else 64)
    args.train_images = args.train_images or (50_000 if cuda else 2048)
    modes = list(MODES if cuda else ("eager",)) if args.modes == "auto" else args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    require(not unknown, f"--modes={args.modes!r} names {unknown}: use a comma-separated list of {', '.join(MODES)}")
    require(cuda or modes == ["eager"], f"--modes={args.modes!r}: compiled modes are measured on CUDA only; use eager")
    require(args.train_images >= args.batch_size, f"--train-images={args.train_images} is below one batch")
    try:
        flags = shlex.split(args.experiment_args)
    except ValueError as error:  # an unclosed quote
        raise ConfigError(f"--experiment-args={args.experiment_args!r}: {error}: close the quote") from None
    try:  # refused here, not after minutes of (a)-(c)
        parse_args(Cifar10Args, flags)
    except ConfigError as error:
        raise ConfigError(f"--experiment-args={args.experiment_args!r}: experiments.cifar10 says: {error}") from None
    return modes


def run_bench(args: StepOverheadArgs) -> list[dict[str, object]]:
    cuda = torch.cuda.is_available()
    modes = resolve(args, cuda)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # As the experiment sets them without --deterministic: cuDNN autotuning, and the host memory a step frees kept
    # for the next (without it the bare step's pace would hang on what this process happened to allocate before)
    speed_switches(device, deterministic=False)
    threads = experiment_threads()
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as folder:
        root = Path(folder)
        data.write_standin(root / "data", train_images=args.train_images, test_images=1024)
        train = data.load_split(root / "data", train=True, verify=False)
        store = root / "store"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            rows = measure(args, modes, device, train, root)
        finally:
            dist.destroy_process_group()
    header = (
        f"\nstep overhead: {args.model}, batch {args.batch_size}, {device.type}, one process of {threads} torch "
        f"thread(s), {args.train_images} training images; median (min-max) of n samples"
    )
    if args.experiment_args:
        header += f"\n(d) runs with {args.experiment_args}"
    print(render(rows, header), flush=True)
    result = as_json(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def measure(args: StepOverheadArgs, modes: list[str], device: torch.device, train: data.Split, root: Path) -> list[Row]:
    rows = {(mode, row): Row(mode, row, []) for mode in modes for row in ROWS}
    setups: dict[str, InProcess] = {}
    run_index = 0
    for round_ in range(max(args.repeats, args.runs)):
        for mode in modes:
            setup = setups.get(mode) or setups.setdefault(mode, InProcess(args, mode, device, train))
            bare = rows[mode, "bare"]
            if round_ < args.repeats:
                # each row first in turn: no row always comes first after the experiment's run
                passes = {row: setup.measure(row) for row in IN_PROCESS[round_ % 3 :] + IN_PROCESS[: round_ % 3]}
                for row, images_per_s in passes.items():
                    rows[mode, row].samples.append(images_per_s)
                    rows[mode, row].paired.append(images_per_s / passes["bare"])
            if round_ < args.runs:
                run_index += 1
                steady, around = run_experiment(
                    args, mode, root / "data", root / f"run{run_index}", lambda: setup.measure("bare")
                )
                bare.samples += [around[0][0], *(after for _, after in around)]
                bare.paired += [1.0] * (len(around) + 1)
                rows[mode, "run"].samples.extend(steady)
                rows[mode, "run"].paired.extend(
                    epoch / ((before + after) / 2) for epoch, (before, after) in zip(steady, around)
                )
    return list(rows.values())


main = command_main(StepOverheadArgs, run_bench, doc=__doc__)

if __name__ == "__main__":
    main.run_and_exit()
