"""The seeds' ToyModel (Linear 10->10, ReLU, Linear 10->5) trained with DDP on a synthetic regression task.

Launch (every command from the repository root):

    torchrun --standalone --nproc-per-node=2 -m experiments.toy                 # 2 processes, one machine
    torchrun --standalone --nproc-per-node=2 -m experiments.toy --steps 500 --batch-size 16 --lr 0.1
    python -m experiments.toy --nproc 2                                         # no torchrun: torch.multiprocessing
    python -m experiments.toy                                                   # a world of one

    # two nodes, 2 processes each: run on node 0 with --node-rank=0 and on node 1 with --node-rank=1
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --master-addr=NODE0 --master-port=29500 -m experiments.toy
    # or elastic (c10d) rendezvous, the same command on every node
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 --rdzv-id=toy1 -m experiments.toy

    # checkpoint and stop at step 120 of 200 (no metrics.json), then continue it (same number of processes)
    torchrun --standalone --nproc-per-node=2 -m experiments.toy --run-dir runs/toy/NAME --stop-at-step 120
    torchrun --standalone --nproc-per-node=2 -m experiments.toy --run-dir runs/toy/NAME --resume

With the same global batch (--batch-size x processes) and seed, 1, 2 and 4 processes end with the same
weights up to float32 rounding: the training sampler hands out the same global batch at every step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, TensorDataset

from ddp_core.training.buckets import settle_bucket_layout
from ddp_core.output.checkpoint import CheckpointArgs, restore
from ddp_core.contract_spec import ContractSpec
from ddp_core.config import check_values, option, parse_args, require
from ddp_core.distributed.group import DistContext, process_group, wrap_ddp
from ddp_core.errors import exits_with_one_line
from ddp_core.training.guard import NonFiniteGuard
from ddp_core.process.launch import launch
from ddp_core.output.logging import setup_logging
from ddp_core.process.preemption import GracefulStop
from ddp_core.output.run import start_run
from ddp_core.training.samplers import TrainSampler, global_sum_count
from ddp_core.training.seed import (
    enable_determinism,
    loader_generator,
    seed_everything,
    seed_rank_streams,
)

log = logging.getLogger("toy")
MAX_DATASET_SIZE = 10**7  # about 0.6 GB per rank


@dataclass
class ToyArgs(CheckpointArgs):
    steps: int = option(200, "optimizer steps to train for (in total, counting steps before a resume)", minimum=1)
    batch_size: int = option(32, "samples per process per step; the global batch is this times the number of processes",
                             minimum=1, maximum=MAX_DATASET_SIZE)
    lr: float = option(0.2, "SGD learning rate", above=0)
    checkpoint_every: int = option(50, "write checkpoints/last.pt every N steps (0: only at the end)", minimum=0)
    dataset_size: int = option(4096, "samples in the synthetic regression dataset", minimum=1, maximum=MAX_DATASET_SIZE,
                               note="every rank holds it in memory, 60 bytes a sample")
    log_every: int = option(20, "steps between train-loss points (console and TensorBoard), each the mean over its interval and the ranks", minimum=1)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


# What `python -m ddp_core.contract experiments.toy` needs beyond the flags (ddp_core/contract_spec.py).
CONTRACT = ContractSpec(
    model=lambda config: ToyModel(),
    brief=("--steps", "12", "--checkpoint-every", "4", "--log-every", "4", "--dataset-size", "512"),
    stop_at_step=5,
    long=("--steps", "1000000", "--checkpoint-every", "5", "--dataset-size", "512"),
    world_size_invariant=True,  # the sampler deals the same global batch at every step (docstring)
)


def make_dataset(size: int, seed: int) -> TensorDataset:
    """Inputs and targets from a fixed random teacher network plus noise; identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 10, generator=generator)
    teacher_hidden = torch.randn(10, 10, generator=generator) / 10**0.5
    teacher_out = torch.randn(10, 5, generator=generator) / 10**0.5
    targets = torch.relu(inputs @ teacher_hidden) @ teacher_out + 0.05 * torch.randn(size, 5, generator=generator)
    return TensorDataset(inputs, targets)


def validate(args: ToyArgs) -> None:
    """Each option's own range is declared above (parse_args checks it); here what spans several options."""
    check_values(args)  # the declared ranges again, for arguments built in code
    require(
        args.batch_size <= args.dataset_size,
        f"--batch-size={args.batch_size} is larger than --dataset-size={args.dataset_size}: it must be at most the dataset size",
    )
    require(
        args.stop_at_step <= args.steps,
        f"--stop-at-step={args.stop_at_step} is beyond --steps={args.steps}: it must be at most --steps (0: train to the end)",
    )


def train(args: ToyArgs) -> dict[str, float]:
    with process_group(args.dist_config()) as ctx, GracefulStop() as stop:
        metrics = train_in_group(args, ctx, stop)  # its model and optimizer are gone before the group is
    stop.exit_if_stopped()
    return metrics


def train_in_group(args: ToyArgs, ctx: DistContext, stop: GracefulStop) -> dict[str, float]:
    setup_logging()
    if args.deterministic:
        enable_determinism()
    run = start_run("toy", args, ctx, resume=args.resume)

    seed_everything(args.seed)  # same initial weights on every rank
    model = wrap_ddp(ToyModel(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset = make_dataset(args.dataset_size, args.seed)
    sampler = TrainSampler(len(dataset), ctx.rank, ctx.world_size, seed=args.seed)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, generator=loader_generator(args.seed, ctx.rank)
    )
    steps_per_epoch = sampler.num_samples // args.batch_size
    require(
        steps_per_epoch > 0,
        f"--dataset-size={args.dataset_size} gives each of {ctx.world_size} processes fewer than "
        f"--batch-size={args.batch_size} samples: raise --dataset-size or lower --batch-size",
    )

    loss_fn = nn.MSELoss()
    step = 0
    if run.resume:
        checkpoint, resumed_from = run.load_checkpoint()  # the newest that loads, or --resume-from's file
        step, _ = restore(checkpoint, model, optimizer)
        zeros_in, zeros_out = torch.zeros(args.batch_size, 10, device=ctx.device), torch.zeros(args.batch_size, 5, device=ctx.device)
        settle_bucket_layout(model, lambda: loss_fn(model(zeros_in), zeros_out))  # bitwise at 3+ processes too
        log.info("resumed %s at step %d", resumed_from, step)
    else:
        seed_rank_streams(args.seed, ctx.rank)  # from here on, random draws differ per rank
    writer = run.open_writer(purge_step=step if run.resume else None)
    log.info("run directory %s; %d process(es), backend %s, global batch %d", run.dir, ctx.world_size, ctx.backend, args.batch_size * ctx.world_size)

    start_step, started = step, time.perf_counter()
    guard = NonFiniteGuard(ctx.device, advice=f"a lower --lr (now {args.lr:g})")
    loss_sum, loss_count, loss_value = torch.zeros((), dtype=torch.float64, device=ctx.device), 0, float("nan")
    while step < args.steps:
        epoch, batch_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch, start=batch_in_epoch * args.batch_size)
        for inputs, targets in loader:
            inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()
            step += 1
            guard.observe(loss, step)  # on the device: no host read per step
            loss_sum += loss.detach().double()
            loss_count += 1

            # --stop-at-step: checkpoint and stop here; the schedule (--steps) stays that of the whole run.
            # --stop-at-step=--steps is the run's normal end (metrics.json), not a stop.
            at_stop_step = step == args.stop_at_step and step < args.steps
            # Asking the other ranks whether to stop syncs the GPU: on CUDA only once per log interval.
            last = step == args.steps or at_stop_step or ((ctx.device.type == "cpu" or step % args.log_every == 0) and stop.requested())
            save = last or (args.checkpoint_every and step % args.checkpoint_every == 0)
            if save or step % args.log_every == 0:
                guard.check(step, model if save else None, run.checkpoint_path)  # before every save
                total, count = global_sum_count(loss_sum, loss_count)  # averaged over the interval and the ranks
                loss_value = total / count
                loss_sum.zero_()
                loss_count = 0
                # The lr is constant here, but TensorBoard shows the same train/ tags as CIFAR10's.
                writer.add_scalars({"train/loss": loss_value, "train/lr": optimizer.param_groups[0]["lr"]}, step)
                log.info("step %d/%d  epoch %d  loss %.5f", step, args.steps, epoch, loss_value)
            if save:
                run.save_checkpoint(model, optimizer, step, epoch, extra={"loss": loss_value})
            if last:
                break
        if stop.stopped or at_stop_step:
            # The checkpoint is written; no metrics.json, since the run has not ended (as CIFAR10's stop_early).
            writer.close()
            stop.report(step, run.dir, args.steps)  # every rank
            return {"steps": step, "stopped_early": True}

    elapsed = time.perf_counter() - started
    metrics = {
        "final_loss": loss_value,
        "steps": step,
        "world_size": ctx.world_size,
        "global_batch_size": args.batch_size * ctx.world_size,
        "samples_per_s": (step - start_step) * args.batch_size * ctx.world_size / max(elapsed, 1e-9),
    }
    writer.add_hparams(asdict(args), {"hparam/final_loss": loss_value}, step)
    writer.close()
    run.finish(metrics)
    log.info("done: final loss %.5f after %d steps; %s (view: make tensorboard)", loss_value, step, run.dir)
    return metrics


@record
@exits_with_one_line
def main(argv: list[str] | None = None) -> dict[str, float] | None:
    args = parse_args(ToyArgs, argv, description=__doc__.splitlines()[0])
    validate(args)
    return launch(train, args)


if __name__ == "__main__":
    from ddp_core.process.exit import run_and_exit  # the script path only: tests call main() in-process

    run_and_exit(main)  # a finished worker leaves before gloo's teardown can abort it (design fact 12)
