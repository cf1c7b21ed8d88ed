"""CIFAR10 with DDP and synchronized batch norm: ResNet-18 (or a small CNN), exact evaluation, resumable.

Launch (every command from the repository root):

    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --download           # first run: fetch the data
    torchrun --standalone --nproc-per-node=8 -m experiments.cifar10 --epochs 20          # every GPU of a node
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --model small --epochs 2   # two CPU cores
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --loader torchvision  # the textbook pipeline
    python -m experiments.cifar10 --nproc 2 --model small                                 # no torchrun
    torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --model small --amp   # bf16 autocast on CPU

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

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_core.training.amp import AMP_DTYPES, AmpPlan, choose_amp, restore_scaler, scaler_state
from ddp_core.training.buckets import settle_bucket_layout
from ddp_core.output.checkpoint import CheckpointArgs, restore
from ddp_core.contract_spec import ContractSpec
from ddp_core.config import check_values, directory_problem, option, parse_args, require
from ddp_core.distributed.group import DistContext, process_group, unwrap, wrap_ddp
from ddp_core.errors import exits_with_one_line
from ddp_core.training.guard import NonFiniteGuard
from ddp_core.process.launch import launch
from ddp_core.output.figures import confusion_figure, prediction_grid
from ddp_core.output.logging import RankZeroWriter, progress, setup_logging
from ddp_core.training.metrics import ClassificationMeter, ClassificationResult, confusion_markdown, log_interval
from ddp_core.process.preemption import GracefulStop
from ddp_core.output.run import Run, start_run
from ddp_core.training.samplers import TrainSampler, global_sum_count
from ddp_core.training.schedules import SCHEDULES, lr_at
from ddp_core.training.seed import enable_determinism, seed_everything, seed_rank_streams
from ddp_core.distributed.sync_batchnorm import SYNC_BN_IMPLS, convert_sync_batchnorm
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
    lr: float = option(0.2, "peak learning rate for a global batch of 256 (scaled linearly with the global batch)", above=0)
    momentum: float = option(0.9, "SGD Nesterov momentum", above=0, below=1, note="Nesterov momentum needs one above 0")
    weight_decay: float = option(5e-4, "L2 weight decay", minimum=0)
    label_smoothing: float = option(0.1, "cross-entropy label smoothing", minimum=0, below=1)
    schedule: str = option("onecycle", "learning-rate decay after warm-up", choices=SCHEDULES)
    warmup_epochs: float = option(1.0, "linear warm-up length, in epochs (at most --epochs)", minimum=0)
    grad_accum: int = option(1, "micro-steps per optimizer step; gradients are synchronised on the last one only", minimum=1)
    sync_bn: bool = option(True, "batch-norm statistics over the global batch (off: per-rank BatchNorm)")
    sync_bn_impl: str = option("auto", "synchronized batch norm: torch (nn.SyncBatchNorm, CUDA only), global (ddp-lab's GlobalBatchNorm: "
                                       "no host sync, compiles to one graph) or auto (torch on CUDA without --compile, else global)",
                               choices=("auto", *SYNC_BN_IMPLS))
    amp: bool | None = option(None, "autocast and channels_last (default: on with CUDA, off on CPU)")
    amp_dtype: str = option("auto", "autocast dtype: auto (bf16 where native; fp16 with a GradScaler on GPUs without bf16, e.g. T4, V100); bf16 or fp16 force it and imply --amp", choices=AMP_DTYPES)
    compile: bool = option(False, "torch.compile the model")
    data_dir: str = option("data", "folder holding cifar-10-batches-py/", env="DATA_DIR", path="dir")
    download: bool = option(False, "download the data first if it is missing (one process per filesystem, under a file lock)")
    verify: bool = option(True, "check the official archive's md5 sums (--no-verify for another dataset in the same format)")
    loader: str = option("tensor", "input pipeline: tensor (data resident, batched augmentation) or torchvision", choices=("tensor", "torchvision"))
    num_workers: int = option(2, "DataLoader workers per process (torchvision loader)", minimum=0, maximum=MAX_NUM_WORKERS)
    eval_batch_size: int = option(1024, "images per process per evaluation batch", minimum=1)
    checkpoint_every_steps: int = option(0, "also write checkpoints/last.pt every N optimizer steps (0: once per epoch)", minimum=0)
    log_every: int = option(0, "optimizer steps between train-loss and learning-rate points in TensorBoard, each the mean over "
                               "its interval and the ranks (0: about 10 an epoch, steps per epoch // 10, at least 1)", minimum=0)


# What `python -m ddp_core.contract experiments.cifar10 -- --data-dir DIR` needs beyond the flags (ddp_core/contract_spec.py).
CONTRACT = ContractSpec(
    model=lambda config: build_model(config["model"], num_classes=len(data.CLASSES)),
    brief=("--model", "small", "--epochs", "2", "--eval-batch-size", "64", "--checkpoint-every-steps", "4"),
    stop_at_step=5,  # mid-epoch at 1, 2 and 3 processes on a small dataset
    long=("--model", "small", "--epochs", "100000", "--eval-batch-size", "64", "--checkpoint-every-steps", "3"),
    world_size_invariant=False,  # augmentation draws from per-rank streams
    batch_size=32,
)


def validate(args: Cifar10Args) -> None:
    """Each option's own range is declared above (parse_args checks it); here what spans several options."""
    check_values(args)  # the declared ranges again, for arguments built in code
    require(args.warmup_epochs <= args.epochs,
            f"--warmup-epochs={args.warmup_epochs} is longer than --epochs={args.epochs}: it must be at most --epochs")
    require(args.sync_bn_impl != "torch" or expected_device_type(args) == "cuda",
            "--sync-bn-impl=torch needs CUDA (torch's SyncBatchNorm refuses CPU tensors): use global or auto on this machine")
    require(args.amp is not False or args.amp_dtype == "auto",
            f"--no-amp turns autocast off but --amp-dtype={args.amp_dtype} asks for it: drop one of them")
    if not args.download:  # here, before any process starts: one line, however many processes --nproc asks for
        folder = data.dataset_folder(args.data_dir).resolve()
        require(folder.is_dir(), f"CIFAR10 not found: --data-dir={args.data_dir!r} (DATA_DIR) has no folder {folder}; "
                                 f"{data._how_to_get_it(folder.parent)}")
    else:  # every process takes the download lock in it; the first one downloads into it
        problem = directory_problem(args.data_dir, writable=True)
        require(problem is None, f"--data-dir={args.data_dir!r} (DATA_DIR) {problem}: --download needs a directory every process can write into")


def expected_device_type(args: Cifar10Args) -> str:
    """The device kind process_group will choose (ddp_core.distributed.group.resolve_backend), known before it runs."""
    return "cuda" if args.backend != "gloo" and torch.cuda.is_available() else "cpu"


def sync_bn_impl(args: Cifar10Args, device: torch.device) -> str:
    """auto: torch's SyncBatchNorm for eager CUDA (fused kernels, measured on GPUs before), GlobalBatchNorm
    under --compile (torch's breaks the graph at every layer and reads a mask on the host) and on CPU."""
    if args.sync_bn_impl != "auto":
        return args.sync_bn_impl
    return "torch" if device.type == "cuda" and not args.compile else "global"


# ---------------------------------------------------------------------------------------------- data

def fetch_data(args: Cifar10Args) -> tuple[data.Split, data.Split]:
    """Before the process group exists: a download (once per filesystem, under a file lock) is no collective,
    so no DIST_TIMEOUT_S can expire during it; missing or corrupt data is a ConfigError on every process."""
    if args.download:
        data.download_once(args.data_dir, verify=args.verify)
    return data.load_split(args.data_dir, train=True, verify=args.verify), data.load_split(args.data_dir, train=False, verify=args.verify)


# --------------------------------------------------------------------------------------------- model

def build(args: Cifar10Args, ctx: DistContext, channels_last: bool) -> nn.Module:
    seed_everything(args.seed)  # identical initial weights on every rank
    model = build_model(args.model, num_classes=len(data.CLASSES))
    if args.sync_bn and ctx.world_size > 1:
        model = convert_sync_batchnorm(model, ctx.device, sync_bn_impl(args, ctx.device))  # before the DDP wrap
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return wrap_ddp(model, ctx)


def make_optimizer(model: nn.Module, args: Cifar10Args) -> torch.optim.SGD:
    # No weight decay on batch-norm parameters and biases (1-D tensors): decaying them only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, nesterov=True)


# ---------------------------------------------------------------------------------------- evaluation

@dataclass
class Predictions:
    """A few test images (normalised, as the model saw them) with their true and predicted classes."""
    images: torch.Tensor
    labels: torch.Tensor
    predicted: torch.Tensor


@torch.no_grad()
def evaluate(model: nn.Module, test_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], ctx: DistContext, autocast,
             keep: int = 0) -> tuple[ClassificationResult, Predictions | None]:
    """Every test image counted exactly once for any world size: unpadded shards, summed confusion matrices.

    ``test_batches``: ``data.eval_batches``, built once per run (the test set then stays on the device).
    ``keep``: also return this rank's first ``keep`` test images with their predictions (no collective).
    """
    net = unwrap(model)  # ranks hold different counts: no DDP collectives inside forward
    net.eval()
    meter = ClassificationMeter(len(data.CLASSES), ctx.device)
    kept = None
    for images, labels in test_batches:
        with autocast():
            logits = net(images).float()
        meter.update(logits, labels, nn.functional.cross_entropy(logits, labels, reduction="sum"))
        if kept is None and keep:  # still on the device: copied to the host after reduce's sync, not here
            kept = Predictions(images[:keep].clone(), labels[:keep].clone(), logits[:keep].argmax(dim=1))
    net.train()
    return meter.reduce(), kept


def log_evaluation(writer: RankZeroWriter, result: ClassificationResult, shown: Predictions | None, step: int) -> None:
    """Scalars for the curves; on rank 0 also the labelled confusion matrix and captioned test images."""
    writer.add_scalars({"eval/loss": result.loss, "eval/accuracy": result.accuracy}, step)
    writer.add_scalars({f"eval/accuracy_per_class/{name}": accuracy for name, accuracy in zip(data.CLASSES, result.per_class_accuracy)}, step)
    if not writer.writing:  # drawing is rank 0's work only
        return
    writer.add_image("eval/confusion_matrix", confusion_figure(result.confusion, data.CLASSES), step)
    writer.add_text("eval/confusion_matrix", confusion_markdown(result.confusion, list(data.CLASSES)), step)
    if shown is not None:
        pictures = data.unnormalise(shown.images)
        writer.add_image("eval/predictions", prediction_grid(pictures, shown.predicted.cpu(), shown.labels.cpu(), data.CLASSES), step)


# ------------------------------------------------------------------------------------------ training

def train(args: Cifar10Args) -> dict[str, float]:
    train_set, test_set = fetch_data(args)
    with process_group(args.dist_config()) as ctx, GracefulStop() as stop:
        setup_logging()
        if args.deterministic:
            enable_determinism()
        speed_switches(ctx.device, args.deterministic)
        run = start_run("cifar10", args, ctx, resume=args.resume)
        metrics = fit(args, ctx, run, train_set, test_set, stop)  # the model is gone before the group is
    stop.exit_if_stopped()
    return metrics


def speed_switches(device: torch.device, deterministic: bool) -> None:
    """cuDNN autotuning on CUDA: the first batch of each shape tries the convolution algorithms and keeps the
    fastest. The shapes here are fixed (drop_last), so it costs seconds once. Its choice can differ between
    runs, so not with --deterministic (enable_determinism turns it off)."""
    if device.type == "cuda" and not deterministic:
        torch.backends.cudnn.benchmark = True


def fit(args: Cifar10Args, ctx: DistContext, run: Run, train_set: data.Split, test_set: data.Split, stop: GracefulStop) -> dict[str, float]:
    plan = choose_amp(ctx.device, args.amp, args.amp_dtype)
    amp, autocast = plan.enabled, plan.autocast
    scaler = plan.grad_scaler()  # fp16 only; otherwise it passes everything through unchanged
    model = build(args, ctx, channels_last=amp)
    optimizer = make_optimizer(model, args)
    forward = torch.compile(model) if args.compile else model
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    sampler = TrainSampler(len(train_set.labels), ctx.rank, ctx.world_size, seed=args.seed)
    loader = data.train_loader(train_set, sampler, args.batch_size, args.loader, ctx.device, args.num_workers, args.seed, ctx.rank, channels_last=amp)
    # Built once: the tensor pipeline uploads the test set to the device here, not at every evaluation.
    test_batches = data.eval_batches(test_set, ctx.rank, ctx.world_size, args.eval_batch_size, ctx.device, channels_last=amp)
    steps_per_epoch = len(loader) // args.grad_accum
    require(steps_per_epoch > 0, f"each process gets {len(loader)} batches per epoch, fewer than --grad-accum={args.grad_accum}: lower --batch-size or --grad-accum")
    global_batch = args.batch_size * ctx.world_size * args.grad_accum
    peak_lr = args.lr * global_batch / 256
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = round(args.warmup_epochs * steps_per_epoch)
    log_every = log_interval(steps_per_epoch, args.log_every)  # also how often CUDA ranks ask each other about a stop

    step = 0
    if run.resume:
        checkpoint, resumed_from = run.load_checkpoint()  # the newest that loads, or --resume-from's file
        step, _ = restore(checkpoint, model, optimizer)
        mismatch = restore_scaler(scaler, checkpoint.get("extra", {}))
        if mismatch:
            log.warning("%s; this resume will not be exact", mismatch)
        settle_bucket_layout(model, lambda: sample_loss(forward, loss_fn, args.batch_size, ctx.device, amp, autocast))
        log.info("resumed %s at step %d", resumed_from, step)
    else:
        seed_rank_streams(args.seed, ctx.rank)  # augmentation differs per rank from here on
    writer = run.open_writer(purge_step=step if run.resume else None)
    log.info(
        "%s on %d process(es), %s/%s, global batch %d, peak lr %.3g, %d steps per epoch (train loss every %d), amp %s, sync-bn %s, loader %s",
        args.model, ctx.world_size, ctx.backend, ctx.device.type, global_batch, peak_lr, steps_per_epoch, log_every, plan.describe(),
        sync_bn_impl(args, ctx.device) if args.sync_bn and ctx.world_size > 1 else "off", args.loader,
    )

    guard = NonFiniteGuard(ctx.device, advice=f"a lower --lr (now {args.lr:g})" + (", or --no-amp" if amp else ""))
    shown_images = SHOWN_PREDICTIONS if writer.writing else 0  # rank 0 draws them; the others keep none
    result: ClassificationResult | None = None
    trained_images, train_seconds = 0, 0.0
    for epoch in range(step // steps_per_epoch, args.epochs):
        first_batch = (step - epoch * steps_per_epoch) * args.grad_accum
        sampler.set_epoch(epoch, start=first_batch * args.batch_size)
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        loss_count = micro_batches = 0
        started = time.perf_counter()
        bar = progress(loader, total=steps_per_epoch * args.grad_accum, initial=first_batch, desc=f"epoch {epoch + 1}/{args.epochs}")
        for batch_index, (images, labels) in enumerate(bar, start=first_batch):
            if batch_index >= steps_per_epoch * args.grad_accum:
                break  # an incomplete accumulation at the end of the epoch is dropped
            if step == 0 and batch_index == 0:
                writer.add_image("train/augmented_batch", data.image_grid(images[:32]), 0)
            sync = (batch_index + 1) % args.grad_accum == 0
            # Micro-steps that do not end an accumulation skip DDP's gradient all-reduce.
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast():
                    loss = loss_fn(forward(images), labels)
                scaler.scale(loss / args.grad_accum).backward()  # fp16: scaled so small gradients do not underflow
            guard.observe(loss, step + 1)  # on the device: no host read per step
            loss_sum += loss.detach().double()
            loss_count += 1
            micro_batches += 1
            if not sync:
                continue
            lr = lr_at(step, total_steps, peak_lr, warmup_steps, args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            scaler.unscale_(optimizer)  # true gradients from here: whatever reads them (clipping) goes after this
            # An fp16 step whose gradients overflowed is skipped and the scale lowered; its loss was finite, so
            # the guard, which watches the loss, lets it pass. (On CUDA this reads one flag per step: fp16 only.)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            # The epoch's end too: its last steps would otherwise be lost when the interval does not divide it.
            if step % log_every == 0 or step % steps_per_epoch == 0:
                guard.check(step, checkpoint=run.checkpoint_path)  # where the loop synchronizes anyway
                total, count = global_sum_count(loss_sum, loss_count)  # one sync per log interval, not per step
                writer.add_scalars({"train/loss": total / count, "train/lr": lr}, step)
                done = micro_batches * args.batch_size * ctx.world_size
                bar.set_postfix(loss=f"{total / count:.3f}", lr=f"{lr:.3g}", images_per_s=f"{done / (time.perf_counter() - started):.0f}")
                loss_sum.zero_()
                loss_count = 0
            if step % steps_per_epoch == 0:
                continue  # the end of the epoch: evaluated and checkpointed below
            # Asking the other ranks whether to stop syncs the GPU: on CUDA only once per log interval.
            stopping = step == args.stop_at_step or ((ctx.device.type == "cpu" or step % log_every == 0) and stop.requested())
            if stopping or (args.checkpoint_every_steps and step % args.checkpoint_every_steps == 0):
                guard.check(step, model, run.checkpoint_path)  # never a checkpoint with a non-finite value
                run.save_checkpoint(model, optimizer, step, epoch, extra=scaler_state(scaler))
            if stopping:
                return stop_early(run, writer, step, total_steps, stop)
        bar.close()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        images_done = micro_batches * args.batch_size * ctx.world_size
        trained_images, train_seconds = trained_images + images_done, train_seconds + seconds
        writer.add_scalar("train/images_per_s", images_done / seconds, step)

        guard.check(step, model, run.checkpoint_path)  # before evaluating and checkpointing non-finite weights
        result, shown = evaluate(model, test_batches, ctx, autocast, keep=shown_images)
        log_evaluation(writer, result, shown, step)
        run.save_checkpoint(model, optimizer, step, epoch + 1, extra=scaler_state(scaler))
        log.info(
            "epoch %d/%d  step %d  eval accuracy %.4f  eval loss %.4f  %.0f images/s  (%d test images)",
            epoch + 1, args.epochs, step, result.accuracy, result.loss, images_done / seconds, result.samples,
        )
        if step == args.stop_at_step or stop.requested():
            return stop_early(run, writer, step, total_steps, stop)

    if result is None:  # resumed a finished run: evaluate once so the metrics are complete
        result, shown = evaluate(model, test_batches, ctx, autocast, keep=shown_images)
        log_evaluation(writer, result, shown, step)
    return finish(run, writer, args, result, trained_images / max(train_seconds, 1e-9), step, plan)


def sample_loss(forward: Callable[[torch.Tensor], torch.Tensor], loss_fn: nn.Module, batch_size: int,
                device: torch.device, channels_last: bool, autocast: Callable[[], Any]) -> torch.Tensor:
    """A training step's loss on a batch of zeros: the same graph as a real step, for settle_bucket_layout."""
    images = torch.zeros(batch_size, 3, 32, 32, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast():
        return loss_fn(forward(images), torch.zeros(batch_size, dtype=torch.long, device=device))


def stop_early(run: Run, writer: RankZeroWriter, step: int, total_steps: int, stop: GracefulStop) -> dict[str, float]:
    """--stop-at-step or a stop signal: the checkpoint is written; no metrics.json, since the run has not ended."""
    writer.close()
    stop.report(step, run.dir, total_steps)  # every rank
    return {"steps": step, "stopped_early": True}


def finish(run: Run, writer: RankZeroWriter, args: Cifar10Args, result: ClassificationResult, images_per_s: float, step: int,
           plan: AmpPlan) -> dict[str, float]:
    per_class = dict(zip(data.CLASSES, result.per_class_accuracy))  # its figures are in TensorBoard already
    metrics = {
        "eval_accuracy": result.accuracy,
        "eval_loss": result.loss,
        "eval_samples": result.samples,
        "images_per_s": images_per_s,
        "steps": step,
        "per_class_accuracy": per_class,
        "amp": plan.describe(),  # what auto chose on this machine: bf16, fp16 + GradScaler or off
    }
    if torch.cuda.is_initialized():  # rank 0's GPU: ranks hold the same model and batch size
        metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    writer.add_hparams(asdict(args), {"hparam/eval_accuracy": result.accuracy, "hparam/eval_loss": result.loss}, step)
    writer.close()
    run.finish(metrics)
    log.info("done: eval accuracy %.4f on %d images; per class: %s; %s",
             result.accuracy, result.samples, ", ".join(f"{k} {v:.3f}" for k, v in per_class.items()), run.dir)
    return metrics


@record
@exits_with_one_line
def main(argv: list[str] | None = None) -> dict[str, float] | None:
    args = parse_args(Cifar10Args, argv, description=__doc__.splitlines()[0])
    validate(args)
    return launch(train, args)


if __name__ == "__main__":
    from ddp_core.process.exit import run_and_exit  # the script path only: tests call main() in-process

    run_and_exit(main)  # a finished worker leaves before gloo's teardown can abort it (design fact 12)
