"""CIFAR10 with DDP and synchronized batch norm: ResNet-18 (or a small CNN), exact evaluation, resumable.

Launch (every command from the repository root):

    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --download           # first run: fetch the data
    torchrun --standalone --nproc-per-node=8 -m experiments.cifar10 --epochs 20          # every GPU of a node
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --model small --epochs 2   # two CPU cores
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --loader torchvision  # the textbook pipeline
    python -m experiments.cifar10 --nproc 2 --model small                                 # no torchrun
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --model small --amp   # bf16 autocast on CPU
    # one GPU past its launch bound: the compiled step replayed as CUDA graphs
    torchrun --standalone --nproc-per-node=1 -m experiments.cifar10 --batch-size 512 --cuda-graphs

    # continue an interrupted run (same number of processes), mid-epoch included
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --run-dir runs/cifar10/NAME --resume

The data is torchvision's `cifar-10-batches-py/` under --data-dir (default data/). `--download` fetches it
before training starts, once per filesystem: every process takes a lock in --data-dir, the first one
downloads, the others then find the data (each node without a shared filesystem downloads its own copy).
--lr is the peak learning rate for a global batch of 256 and scales linearly with the global batch
(--batch-size x processes x --grad-accum).

Autocast (--amp: on by default with CUDA) uses bf16 where the device has it natively and fp16 with a
GradScaler on GPUs without it (T4, V100); --amp-dtype forces one (fp16 on CPU runs the scaler path).
Weights, optimizer state and checkpoints stay float32; the scaler's state is checkpointed with them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ddp_core.config import directory_problem, option, require
from ddp_core.contract_spec import ContractSpec
from ddp_core.distributed.group import unwrap
from ddp_core.distributed.sync_batchnorm import SYNC_BN_IMPLS, convert_sync_batchnorm
from ddp_core.experiment import TrainingRun, experiment_main
from ddp_core.output.checkpoint import CheckpointArgs
from ddp_core.output.figures import confusion_figure, prediction_grid
from ddp_core.output.logging import RankZeroWriter
from ddp_core.ranks import is_global_rank0
from ddp_core.training.amp import AMP_DTYPES, choose_amp
from ddp_core.training.metrics import ClassificationMeter, ClassificationResult, confusion_markdown
from ddp_core.training.samplers import TrainSampler
from ddp_core.training.schedules import SCHEDULES, lr_at
from experiments import cifar10_data as data
from experiments.cifar10_models import MODELS, build_model

log = logging.getLogger("cifar10")
MAX_NUM_WORKERS = 256
SHOWN_PREDICTIONS = 32  # test images in TensorBoard's eval/predictions grid


@dataclass
class Cifar10Args(CheckpointArgs):
    model: str = option("resnet18", "network", choices=MODELS)
    epochs: int = option(10, "training epochs", minimum=1)
    batch_size: int = option(256, "images per process per micro-step", minimum=1)
    lr: float = option(0.2, "peak learning rate for a global batch of 256 (scaled with it)", above=0, role="lr")
    momentum: float = option(0.9, "SGD Nesterov momentum", above=0, below=1, note="Nesterov momentum needs one above 0")
    weight_decay: float = option(5e-4, "L2 weight decay", minimum=0)
    label_smoothing: float = option(0.1, "cross-entropy label smoothing", minimum=0, below=1)
    schedule: str = option("onecycle", "learning-rate decay after warm-up", choices=SCHEDULES)
    warmup_epochs: float = option(1.0, "linear warm-up length, in epochs (at most --epochs)", minimum=0)
    grad_accum: int = option(
        1, "micro-steps per optimizer step; gradients are synchronised on the last one only", minimum=1
    )
    sync_bn: bool = option(True, "batch-norm statistics over the global batch (off: per-rank BatchNorm)")
    sync_bn_impl: str = option(
        "auto",
        "synchronized batch norm: torch (nn.SyncBatchNorm, CUDA only), global (ddp-lab's GlobalBatchNorm: "
        "no host sync, compiles to one graph) or auto (torch on CUDA without --compile or --cuda-graphs, else global)",
        choices=("auto", *SYNC_BN_IMPLS),
    )
    amp: bool | None = option(None, "autocast and channels_last (default: on with CUDA, off on CPU)")
    amp_dtype: str = option(
        "auto",
        "autocast dtype: auto (bf16 where native; fp16 with a GradScaler on GPUs without bf16, e.g. T4, V100); bf16 or "
        "fp16 force it and imply --amp",
        choices=AMP_DTYPES,
    )
    compile: bool = option(False, "torch.compile the model")
    cuda_graphs: bool = option(
        False,
        "replay the compiled step as CUDA graphs (torch.compile's reduce-overhead mode): far fewer kernel "
        "launches, for batches too small to keep a GPU busy; implies --compile; CUDA only",
    )
    data_dir: str = option("data", "folder holding cifar-10-batches-py/", env="DATA_DIR", path="dir", computation=False)
    download: bool = option(
        False,
        "download the data first if it is missing (one process per filesystem, under a file lock)",
        computation=False,
    )
    verify: bool = option(
        True,
        "check the official archive's md5 sums (--no-verify for another dataset in the same format)",
        computation=False,
    )
    loader: str = option(
        "tensor",
        "input pipeline: tensor (data resident, batched augmentation) or torchvision",
        choices=("tensor", "torchvision"),
    )
    num_workers: int = option(
        2, "DataLoader workers per process (torchvision loader)", minimum=0, maximum=MAX_NUM_WORKERS
    )
    eval_batch_size: int = option(1024, "images per process per evaluation batch", minimum=1, computation=False)
    checkpoint_every_steps: int = option(
        0, "also write checkpoints/last.pt every N optimizer steps (0: once per epoch)", minimum=0, computation=False
    )
    log_every: int = option(
        0,
        "optimizer steps between train-loss and learning-rate points in TensorBoard, each the mean over "
        "its interval and the ranks (0: about 10 an epoch, steps per epoch // 10, at least 1)",
        minimum=0,
        computation=False,
    )


# What `python -m ddp_core.contract experiments.cifar10 -- --data-dir DIR` needs beyond the flags
# (ddp_core/contract_spec.py).
CONTRACT = ContractSpec(
    model=lambda config: build_model(config["model"], num_classes=len(data.CLASSES)),
    brief=("--model", "small", "--epochs", "2", "--eval-batch-size", "64", "--checkpoint-every-steps", "4"),
    stop_at_step=5,  # mid-epoch at 1, 2 and 3 processes on a small dataset
    long=("--model", "small", "--epochs", "100000", "--eval-batch-size", "64", "--checkpoint-every-steps", "3"),
    world_size_invariant=False,  # augmentation draws from per-rank streams
    batch_size=32,
)


def validate(args: Cifar10Args) -> None:
    """What spans several options (each option's range is declared above), checked before any process starts."""
    require(
        args.warmup_epochs <= args.epochs,
        f"--warmup-epochs={args.warmup_epochs} is longer than --epochs={args.epochs}: it must be at most --epochs",
    )
    require(
        args.sync_bn_impl != "torch" or expected_device_type(args) == "cuda",
        "--sync-bn-impl=torch needs CUDA (torch's SyncBatchNorm refuses CPU tensors): use global or auto on this "
        "machine",
    )
    require(
        not args.cuda_graphs or expected_device_type(args) == "cuda",
        "--cuda-graphs needs CUDA (CUDA graphs record GPU kernels): drop it on this machine, or use --compile alone",
    )
    require(
        args.amp is not False or args.amp_dtype == "auto",
        f"--no-amp turns autocast off but --amp-dtype={args.amp_dtype} asks for it: drop one of them",
    )
    if not args.download:  # here, before any process starts: one line, however many processes --nproc asks for
        folder = data.dataset_folder(args.data_dir).resolve()
        require(
            folder.is_dir(),
            f"CIFAR10 not found: --data-dir={args.data_dir!r} (DATA_DIR) has no folder {folder}; "
            f"{data._how_to_get_it(folder.parent)}",
        )
    else:  # every process takes the download lock in it; the first one downloads into it
        problem = directory_problem(args.data_dir, writable=True)
        require(
            problem is None,
            f"--data-dir={args.data_dir!r} (DATA_DIR) {problem}: --download needs a directory every process can write "
            "into",
        )


def expected_device_type(args: Cifar10Args) -> str:
    """The device kind process_group will choose (ddp_core.distributed.group.resolve_backend), known before it runs."""
    return "cuda" if args.backend != "gloo" and torch.cuda.is_available() else "cpu"


def sync_bn_impl(args: Cifar10Args, device: torch.device) -> str:
    """auto: torch's SyncBatchNorm for eager CUDA (fused kernels, measured on GPUs before), GlobalBatchNorm
    under --compile (torch's breaks the graph at every layer and reads a mask on the host) and on CPU."""
    if args.sync_bn_impl != "auto":
        return args.sync_bn_impl
    return "torch" if device.type == "cuda" and not compiled(args) else "global"


def compiled(args: Cifar10Args) -> bool:
    return args.compile or args.cuda_graphs


def compile_forward(model: nn.Module, args: Cifar10Args) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module the training step calls: the DDP model itself, compiled, or compiled and replayed as CUDA graphs.

    Under CUDA graphs each call first marks a new step, so the graphs' output buffers from the step
    before may be reused (the loss and the guard have read them by then); the parameters, updated in
    place by the optimizer and by a resume's load, keep the addresses the graphs were recorded with."""
    if not compiled(args):
        return model
    module = torch.compile(model, mode="reduce-overhead" if args.cuda_graphs else None)
    if not args.cuda_graphs:
        return module

    def forward(images: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return module(images)

    return forward


def fetch_data(args: Cifar10Args) -> tuple[data.Split, data.Split]:
    """Before the process group exists: a download (once per filesystem, under a file lock) is no collective,
    so no DIST_TIMEOUT_S can expire during it; missing or corrupt data is a ConfigError on every process."""
    if args.download:
        data.download_once(args.data_dir, verify=args.verify)
    return data.load_split(args.data_dir, train=True, verify=args.verify), data.load_split(
        args.data_dir, train=False, verify=args.verify
    )


def build(args: Cifar10Args, device: torch.device, world_size: int, channels_last: bool) -> nn.Module:
    """The plain model (the run seeded every rank alike), its batch norm synchronized across the ranks."""
    model = build_model(args.model, num_classes=len(data.CLASSES))
    if args.sync_bn and world_size > 1:
        model = convert_sync_batchnorm(model, device, sync_bn_impl(args, device))  # before the DDP wrap
    return model.to(memory_format=torch.channels_last) if channels_last else model


def make_optimizer(model: nn.Module, args: Cifar10Args) -> torch.optim.SGD:
    # No weight decay on batch-norm parameters and biases (1-D tensors): decaying them only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, nesterov=True)


@torch.no_grad()
def evaluate(
    model: nn.Module, test_batches, device: torch.device, autocast, writer: RankZeroWriter, step: int
) -> ClassificationResult:
    """Every test image counted exactly once for any world size: unpadded shards, summed confusion matrices.
    Rank 0 also draws the labelled confusion matrix and its first test images with their predictions."""
    net = unwrap(model).eval()  # ranks hold different counts: no DDP collectives inside forward
    meter, shown = ClassificationMeter(len(data.CLASSES), device), None
    for images, labels in test_batches:
        with autocast():
            logits = net(images).float()
        meter.update(logits, labels, nn.functional.cross_entropy(logits, labels, reduction="sum"))
        if shown is None and is_global_rank0():  # still on the device: copied to the host after reduce's sync
            shown = (
                images[:SHOWN_PREDICTIONS].clone(),
                labels[:SHOWN_PREDICTIONS].clone(),
                logits[:SHOWN_PREDICTIONS].argmax(dim=1),
            )
    net.train()
    result = meter.reduce()
    writer.add_scalars(
        {f"eval/accuracy_per_class/{name}": value for name, value in zip(data.CLASSES, result.per_class_accuracy)}, step
    )
    if shown is not None:  # drawing is rank 0's work only
        writer.add_image("eval/confusion_matrix", confusion_figure(result.confusion, data.CLASSES), step)
        writer.add_text("eval/confusion_matrix", confusion_markdown(result.confusion, list(data.CLASSES)), step)
        images, labels, predicted = shown
        writer.add_image(
            "eval/predictions",
            prediction_grid(data.unnormalise(images), predicted.cpu(), labels.cpu(), data.CLASSES),
            step,
        )
    return result


def train(run: TrainingRun, args: Cifar10Args, splits: tuple[data.Split, data.Split]) -> dict[str, float]:
    train_set, test_set = splits
    amp = choose_amp(run.device, args.amp, args.amp_dtype)
    scaler = amp.grad_scaler()  # fp16 only; otherwise it passes everything through unchanged
    model = run.wrap(build(args, run.device, run.world_size, channels_last=amp.enabled))
    optimizer = make_optimizer(model, args)
    forward = compile_forward(model, args)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    sampler = TrainSampler(len(train_set.labels), run.rank, run.world_size, seed=args.seed)
    loader = data.train_loader(
        train_set,
        sampler,
        args.batch_size,
        args.loader,
        run.device,
        args.num_workers,
        args.seed,
        run.rank,
        channels_last=amp.enabled,
    )
    # Built once: the tensor pipeline uploads the test set to the device here, not at every evaluation.
    test_batches = data.eval_batches(
        test_set, run.rank, run.world_size, args.eval_batch_size, run.device, channels_last=amp.enabled
    )
    steps_per_epoch = len(loader) // args.grad_accum
    peak_lr = args.lr * args.batch_size * run.world_size * args.grad_accum / 256
    total_steps = args.epochs * steps_per_epoch
    run.plan(
        total_steps=total_steps,
        loader=loader,
        grad_accum=args.grad_accum,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every_steps,
        per_epoch=True,
        evaluate=lambda: evaluate(model, test_batches, run.device, amp.autocast, run.writer, run.step_count),
        unit="images",
    )
    run.resume_or_start(model, optimizer, scaler=scaler)
    log.info(
        "%s, peak lr %.3g, amp %s, sync-bn %s, loader %s",
        args.model,
        peak_lr,
        amp.describe(),
        sync_bn_impl(args, run.device) if args.sync_bn and run.world_size > 1 else "off",
        args.loader,
    )

    for epoch, consumed in run.epochs():
        sampler.set_epoch(epoch, consumed=consumed)
        for index, (images, labels) in enumerate(run.batches(loader)):  # a pass starts at a step boundary
            if run.step_count == 0 and index == 0:
                run.writer.add_image("train/augmented_batch", data.image_grid(images[:32]), 0)
            with run.accumulate(model):  # DDP's all-reduce on the step's last micro-batch only
                with amp.autocast():
                    loss = loss_fn(forward(images), labels)
                scaler.scale(loss / args.grad_accum).backward()  # fp16: scaled so small gradients do not underflow
            run.observe(loss)
            if not run.step_ready:  # an accumulation goes on
                continue
            lr = lr_at(run.step_count, total_steps, peak_lr, round(args.warmup_epochs * steps_per_epoch), args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            scaler.unscale_(optimizer)  # true gradients from here: whatever reads them (clipping) goes after this
            # An fp16 step whose gradients overflowed is skipped and the scale lowered; its loss was finite, so
            # the guard, which watches the loss, lets it pass. (On CUDA this reads one flag per step: fp16 only.)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if run.step(lr=lr):  # logs, evaluates and checkpoints at each epoch's end, stops as planned
                break
    return run.finish(
        lambda: {"per_class_accuracy": run.last_evaluation.accuracy_by_name(data.CLASSES), "amp": amp.describe()}
    )


main = experiment_main("cifar10", Cifar10Args, train, doc=__doc__, validate=validate, prepare=fetch_data)

if __name__ == "__main__":
    main.run_and_exit()
