"""CIFAR10 with DDP and synchronized batch norm: ResNet-18 (or a small CNN), exact evaluation, resumable.

Launch (every command from the repository root):

    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --download  # fetch the data
    python -m ddp_core.torchrun --standalone --nproc-per-node=8 -m experiments.cifar10 --epochs 20   # a node's GPUs
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --model small --epochs 2
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --loader torchvision
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --model small --amp  # bf16, CPU
    python -m experiments.cifar10 --nproc 2 --model small                                 # no torchrun
    # one GPU past its launch bound: the compiled step replayed as CUDA graphs
    python -m ddp_core.torchrun --standalone --nproc-per-node=1 -m experiments.cifar10 --batch-size 512 --cuda-graphs

    # continue an interrupted run (same number of processes), mid-epoch included
    python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --run-dir runs/cifar10/A --resume

The data is torchvision's `cifar-10-batches-py/` under --data-dir (default data/). `--download` fetches it
before training starts, once per filesystem: every process takes a lock in --data-dir, the first one
downloads, the others then find the data (each node without a shared filesystem downloads its own copy).
--lr is the peak learning rate for a global batch of 256 and scales linearly with the global batch
(--batch-size x processes x --grad-accum).

Autocast (--amp: on by default with CUDA) uses bf16 where the device has it natively and fp16 with a
GradScaler on GPUs without it (T4, V100); --amp-dtype forces one (fp16 on CPU runs the scaler path).
Weights, optimizer state and checkpoints stay float32; the scaler's state is checkpointed with them.
--ema DECAY evaluates an exponential moving average of the weights beside them (eval_ema_accuracy beside
eval_accuracy), tracked by the run: checkpointed and resumed with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ddp_core.config import directory_problem, option, require
from ddp_core.contract_spec import ContractSpec
from ddp_core.distributed.group import unwrap
from ddp_core.distributed.sync_batchnorm import SYNC_BN_IMPLS
from ddp_core.errors import ConfigError
from ddp_core.experiment import TrainingArgs, TrainingRun, experiment_main
from ddp_core.output.figures import confusion_figure, prediction_grid
from ddp_core.output.logging import RankZeroWriter
from ddp_core.ranks import on_rank0
from ddp_core.training.amp import AMP_DTYPES, choose_amp
from ddp_core.training.ema import WeightEMA, evaluate_beside
from ddp_core.training.metrics import ClassificationMeter, ClassificationResult, confusion_markdown
from ddp_core.training.optim import fused_on, weight_decay_groups
from ddp_core.training.samplers import TrainSampler
from ddp_core.training.schedules import SCHEDULES, lr_at, set_lr
from experiments import cifar10_data as data
from experiments.cifar10_models import MODELS, build_model, build_synced, compile_forward, sync_bn_choice

log = logging.getLogger("cifar10")
SHOWN = 32  # test images in TensorBoard's eval/predictions grid


@dataclass
class Cifar10Args(TrainingArgs):
    model: str = option("resnet18", "network", choices=MODELS)
    epochs: int = option(10, "training epochs", minimum=1)
    batch_size: int = option(256, "images per process per micro-step", minimum=1)
    lr: float = option(0.2, "peak learning rate for a global batch of 256 (scaled with it)", above=0)
    momentum: float = option(0.9, "SGD Nesterov momentum", above=0, below=1, note="Nesterov momentum needs one above 0")
    weight_decay: float = option(5e-4, "L2 weight decay", minimum=0)
    label_smoothing: float = option(0.1, "cross-entropy label smoothing", minimum=0, below=1)
    schedule: str = option("onecycle", "learning-rate decay after warm-up", choices=SCHEDULES)
    warmup_epochs: float = option(1.0, "linear warm-up length, in epochs (at most --epochs)", minimum=0)
    sync_bn: bool = option(True, "batch-norm statistics over the global batch (off: per-rank BatchNorm)")
    sync_bn_impl: str = option(
        "auto", "torch (CUDA), global or auto (docs/experiments.md)", choices=("auto", *SYNC_BN_IMPLS)
    )
    amp: bool | None = option(None, "autocast and channels_last (default: on with CUDA, off on CPU)")
    amp_dtype: str = option("auto", "autocast dtype (auto: bf16 where native, else fp16)", choices=AMP_DTYPES)
    compile: bool = option(False, "torch.compile the model")
    cuda_graphs: bool = option(False, "replay the compiled step as CUDA graphs (implies --compile; CUDA only)")
    data_dir: str = option("data", "folder holding cifar-10-batches-py/", env="DATA_DIR", path="dir", computation=False)
    download: bool = option(False, "download the data first if missing (once per filesystem)", computation=False)
    verify: bool = option(True, "check the archive's md5 sums (--no-verify: another dataset)", computation=False)
    loader: str = option("tensor", "input pipeline (tensor: resident data)", choices=("tensor", "torchvision"))
    num_workers: int = option(2, "DataLoader workers per process (torchvision loader)", minimum=0, maximum=256)
    eval_batch_size: int = option(1024, "images per process per evaluation batch", minimum=1, computation=False)
    ema: float = option(
        0.0, "also evaluate an average of the weights with this decay (eval_ema_*; 0: none)", minimum=0, below=1
    )


# What `python -m tools.contract experiments.cifar10 -- --data-dir DIR` needs beyond the flags
# (ddp_core/contract_spec.py).
CONTRACT = ContractSpec(
    model=lambda config: build_model(config["model"], num_classes=len(data.CLASSES)),
    brief=tuple("--model small --epochs 2 --eval-batch-size 64 --checkpoint-every 4".split()),
    stop_at_step=5,  # mid-epoch at 1, 2 and 3 processes on a small dataset
    long=tuple("--model small --epochs 100000 --eval-batch-size 64 --checkpoint-every 3".split()),
    world_size_invariant=False,  # augmentation draws from per-rank streams
    batch_size=32,
)


def validate(args: Cifar10Args) -> None:
    """What spans several options (each option's range is declared above), checked before any process starts."""
    cuda = args.backend != "gloo" and torch.cuda.is_available()  # what process_group will choose
    warmup, epochs = args.warmup_epochs, args.epochs
    require(warmup <= epochs, f"--warmup-epochs={warmup} is longer than --epochs={epochs}: it must be at most that")
    require(args.sync_bn_impl != "torch" or cuda, "--sync-bn-impl=torch needs CUDA: use global or auto on this machine")
    require(not args.cuda_graphs or cuda, "--cuda-graphs needs CUDA: drop it on this machine, or use --compile alone")
    dtype = args.amp_dtype
    require(args.amp is not False or dtype == "auto", f"--no-amp turns autocast off but --amp-dtype={dtype} wants it")
    if not args.download:  # here, before any process starts: one line, however many processes --nproc asks for
        folder = data.dataset_folder(args.data_dir).resolve()
        where = f"--data-dir={args.data_dir!r} (DATA_DIR) has no folder {folder}"
        require(folder.is_dir(), f"CIFAR10 not found: {where}; {data.how_to_get_it(folder.parent)}")
    elif problem := directory_problem(args.data_dir, writable=True):  # every process takes the download lock in it
        raise ConfigError(f"--data-dir={args.data_dir!r} (DATA_DIR) {problem}: --download needs one all can write to")


def fetch_data(args: Cifar10Args) -> tuple[data.Split, data.Split]:
    """Before the process group exists: a download (once per filesystem, under a file lock) is no collective,
    so no DIST_TIMEOUT_S can expire during it; missing or corrupt data is a ConfigError on every process."""
    if args.download:
        data.download_once(args.data_dir, verify=args.verify)
    return tuple(data.load_split(args.data_dir, train=train, verify=args.verify) for train in (True, False))


def sync_bn(args: Cifar10Args, device: torch.device, world_size: int) -> str | None:
    """The synchronized batch norm the run uses; None: per-rank BatchNorm (--no-sync-bn, or a world of one)."""
    on = args.sync_bn and world_size > 1
    return sync_bn_choice(args.sync_bn_impl, device, args.compile or args.cuda_graphs) if on else None


def build(args: Cifar10Args, device: torch.device, world_size: int, channels_last: bool) -> nn.Module:
    """The plain model (the run seeded every rank alike), its batch norm synchronized across the ranks."""
    return build_synced(args.model, len(data.CLASSES), device, sync_bn(args, device, world_size), channels_last)


@torch.no_grad()
def evaluate(
    model: nn.Module, test_batches, device: torch.device, autocast, step: int, writer: RankZeroWriter, tag: str = "eval"
) -> ClassificationResult:
    """Every test image counted exactly once for any world size: unpadded shards, summed confusion matrices.
    Rank 0 also draws the labelled confusion matrix and its first test images with their predictions."""
    net = unwrap(model).eval()  # ranks hold different counts: no DDP collectives inside forward
    meter, shown = ClassificationMeter(len(data.CLASSES), device), None
    for images, labels in test_batches:
        with autocast():
            logits = net(images).float()
        meter.update(logits, labels, nn.functional.cross_entropy(logits, labels, reduction="sum"))
        if shown is None:  # rank 0's, still on the device: copied to the host after reduce's sync
            shown = on_rank0(lambda: (images[:SHOWN].clone(), labels[:SHOWN].clone(), logits[:SHOWN].argmax(dim=1)))
    net.train()
    result = meter.reduce()
    writer.add_scalars(
        {f"{tag}/accuracy_per_class/{name}": value for name, value in zip(data.CLASSES, result.per_class_accuracy)},
        step,
    )
    if shown is not None and tag == "eval":  # drawing is rank 0's work only
        writer.add_image("eval/confusion_matrix", confusion_figure(result.confusion, data.CLASSES), step)
        writer.add_text("eval/confusion_matrix", confusion_markdown(result.confusion, list(data.CLASSES)), step)
        images, labels, predicted = shown
        grid = prediction_grid(data.unnormalise(images), predicted.cpu(), labels.cpu(), data.CLASSES)
        writer.add_image("eval/predictions", grid, step)
    return result


def apply_gradients(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, ema: WeightEMA | None, model: nn.Module
) -> None:
    """The optimizer step from the accumulated gradients, then the weights' average and fresh gradients."""
    scaler.unscale_(optimizer)  # true gradients from here: whatever reads them (clipping) goes after this
    # An fp16 step whose gradients overflowed is skipped and the scale lowered; its loss was finite, so
    # the guard, which watches the loss, lets it pass (the fused optimizer reads the flag on the GPU).
    scaler.step(optimizer)
    scaler.update()
    if ema is not None:
        ema.update(model)
    optimizer.zero_grad(set_to_none=True)


def train(run: TrainingRun, args: Cifar10Args, splits: tuple[data.Split, data.Split]) -> dict[str, float]:
    train_set, test_set = splits
    amp = choose_amp(run.device, args.amp, args.amp_dtype)
    scaler = amp.grad_scaler()  # fp16 only; otherwise it passes everything through unchanged
    model = run.wrap(build(args, run.device, run.world_size, channels_last=amp.enabled))
    ema = run.track("ema", WeightEMA(model, args.ema)) if args.ema else None  # checkpointed with the run
    # Nesterov SGD; no weight decay on batch-norm parameters and biases; on a GPU one fused kernel updates them all
    groups = weight_decay_groups(model, args.weight_decay)
    optimizer = torch.optim.SGD(groups, args.lr, args.momentum, nesterov=True, **fused_on(run.device))
    forward = compile_forward(model, args.compile, args.cuda_graphs)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    sampler = TrainSampler(len(train_set.labels), run.rank, run.world_size, seed=args.seed)
    pipeline = dict(pipeline=args.loader, num_workers=args.num_workers, seed=args.seed, channels_last=amp.enabled)
    loader = data.train_loader(train_set, sampler, args.batch_size, device=run.device, rank=run.rank, **pipeline)
    # Built once: the tensor pipeline uploads the test set to the device here, not at every evaluation.
    test_batches = data.eval_batches(
        test_set, run.rank, run.world_size, args.eval_batch_size, run.device, channels_last=amp.enabled
    )
    plan = run.plan(
        loader,
        epochs=args.epochs,
        per_epoch=True,
        evaluate=evaluate_beside(
            lambda tag, step, writer: evaluate(model, test_batches, run.device, amp.autocast, step, writer, tag),
            ema,
            model,
        ),
        unit="images",
    )
    loop = plan.resume_or_start(model, optimizer, scaler=scaler)  # a checkpoint's state, or fresh per-rank streams
    optimizer = loop.optimizer  # under --zero: the sharded one
    peak_lr = plan.scaled_lr(args.lr, reference_batch=256)  # --lr is for a global batch of 256
    warmup_steps = round(args.warmup_epochs * plan.steps_per_epoch)
    synced = sync_bn(args, run.device, run.world_size) or "off"
    log.info(
        "%s, peak lr %.3g, amp %s, sync-bn %s, loader %s", args.model, peak_lr, amp.describe(), synced, args.loader
    )

    for epoch, consumed in loop.epochs():
        sampler.set_epoch(epoch, consumed=consumed)
        for micro_batches in loop.steps(loader):  # an optimizer step: --grad-accum micro-batches
            for images, labels in micro_batches:  # DDP all-reduces the gradients on the last one
                with amp.autocast():
                    loss = loss_fn(forward(images), labels)
                loop.backward(loss)  # / --grad-accum; fp16: scaled so that small gradients do not underflow
            if loop.global_step == 0:
                loop.writer.add_image("train/augmented_batch", data.image_grid(images[:32]), 0)
            lr = set_lr(optimizer, lr_at(loop.global_step, plan.total_steps, peak_lr, warmup_steps, args.schedule))
            apply_gradients(optimizer, scaler, ema, model)
            if loop.step(lr=lr):  # logs, evaluates and checkpoints at each epoch's end, stops as planned
                break
    return loop.finish(
        lambda: {
            "per_class_accuracy": dict(zip(data.CLASSES, loop.last_evaluation.per_class_accuracy)),
            "amp": amp.describe(),
        }
    )


main = experiment_main(
    "cifar10",
    Cifar10Args,
    train,
    doc=__doc__,
    validate=validate,
    prepare=fetch_data,
    headline=("eval_accuracy", "eval_loss"),
)

if __name__ == "__main__":
    main.run_and_exit()
