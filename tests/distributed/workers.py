"""Functions that run inside spawned ranks (module level, so spawned children can import them by name).

``world_checks`` runs every check that needs a working process group in ONE spawn per world size (a
process start costs 2-3 s here) and returns a dict of plain results; the test functions assert on them.
Each section records its own error, so one broken helper fails only its own tests.

Inputs are rank-unique, and the functions below that build them (``tensor_list``, ``varsize_rows``, ...)
are the closed forms the tests compare against: rank r's input is a function of r alone.
"""

from __future__ import annotations

import io
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.harness import context

# ---------------------------------------------------------------- closed-form inputs (shared with the tests)

TENSOR_SHAPES = [(2, 3), (4,), (), (1, 2, 2), (3, 1)]  # five tensors of different shapes, one dtype
SAMPLER_SIZES = {2: 7, 3: 10}  # N samples evaluated on a world of 2 and of 3
LOCAL_BATCH = 4
CHECKPOINT_STEP, CHECKPOINT_EPOCH = 7, 2
SCALARS = [(0, 1.0), (1, 0.5), (2, 0.25)]
HPARAMS = {"lr": 0.1, "optimizer": "sgd", "nesterov": True}
FINAL_LOSS = 0.125


def tensor_list(rank: int) -> list[torch.Tensor]:
    """Rank r's i-th tensor: r*1000 + i*100 + 0, 1, 2, ... in the i-th shape."""
    return [
        (rank * 1000 + i * 100 + torch.arange(math.prod(shape), dtype=torch.float32)).reshape(shape)
        for i, shape in enumerate(TENSOR_SHAPES)
    ]


def same_shape_list(rank: int) -> list[torch.Tensor]:
    """Six tensors of one shape (all_gather_tensors' stacked fast path): r*1000 + i*100 + 0..5."""
    return [(rank * 1000 + i * 100 + torch.arange(6, dtype=torch.float32)).reshape(2, 3) for i in range(6)]


def varsize_rows(rank: int) -> torch.Tensor:
    """Rank r contributes r+1 rows of 3: r*100 + 0, 1, 2, ..."""
    return (rank * 100 + torch.arange((rank + 1) * 3, dtype=torch.float32)).reshape(rank + 1, 3)


def gather_row(rank: int) -> torch.Tensor:
    return torch.tensor([rank, rank * rank, 7 * rank + 1], dtype=torch.float32)


def rank_object(rank: int) -> dict[str, Any]:
    """A picklable object whose pickled size differs per rank."""
    return {"rank": rank, "name": "r" * (rank + 1), "items": list(range(rank)), "nested": (rank, {"sq": rank * rank})}


def print_block_body(rank: int) -> dict[str, int]:
    return {"rank": rank, "cube": rank**3}


def sample_value(i: int) -> float:
    return float(i * i)


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets) of the gradient check; rank r takes rows r*B .. (r+1)*B-1."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(world_size * LOCAL_BATCH, 10, generator=generator)
    targets = torch.randn(world_size * LOCAL_BATCH, 5, generator=generator)
    return inputs, targets


# ---------------------------------------------------------------- the checks, run on every rank

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "gather",
    "gather_object",
    "broadcast_object_list",
)


def _count_collectives(call: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """Run ``call`` with torch.distributed's collectives wrapped to count how often each is called."""
    counts = {name: 0 for name in COLLECTIVES}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return wrapper

    try:
        for name in COLLECTIVES:
            setattr(dist, name, counting(name))
        result = call()
    finally:
        for name in COLLECTIVES:
            setattr(dist, name, originals[name])
    return result, counts


def check_collectives(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_core.distributed import collectives as c

    out: dict[str, Any] = {}
    out["all_gather_tensors"], out["all_gather_tensors_calls"] = _count_collectives(
        lambda: c.all_gather_tensors(tensor_list(rank))
    )
    out["all_gather_same_shape"], out["all_gather_same_shape_calls"] = _count_collectives(
        lambda: c.all_gather_tensors(same_shape_list(rank))
    )
    out["all_gather_varsize"] = c.all_gather_varsize(varsize_rows(rank))
    out["gather_tensors"] = {dst: c.gather_tensors(gather_row(rank), dst=dst) for dst in sorted({0, world_size - 1})}
    out["all_gather_object"] = c.all_gather_object(rank_object(rank))
    out["gather_object"] = {dst: c.gather_object(rank_object(rank), dst=dst) for dst in sorted({0, world_size - 1})}
    out["broadcast_object"] = {
        src: c.broadcast_object(rank_object(rank), src=src) for src in sorted({0, world_size - 1})
    }

    with_body, without_body = io.StringIO(), io.StringIO()
    c.print_in_rank_order("hello", print_block_body(rank), file=with_body)
    c.print_in_rank_order(f"title only {rank}", file=without_body)
    out["print_in_rank_order"] = with_body.getvalue()
    out["print_in_rank_order_no_body"] = without_body.getvalue()
    return out


def check_samplers(rank: int, world_size: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddp_core.distributed.collectives import all_gather_object
    from ddp_core.training.samplers import EvalSampler, global_sum_count

    n = SAMPLER_SIZES[world_size]
    dataset = TensorDataset(torch.tensor([sample_value(i) for i in range(n)], dtype=torch.float64))

    def partial(sampler: Any) -> tuple[torch.Tensor, int]:
        total, count = torch.zeros((), dtype=torch.float64), 0
        for (batch,) in DataLoader(dataset, batch_size=3, sampler=sampler):
            total += batch.sum()
            count += len(batch)
        return total, count

    eval_sampler = EvalSampler(n, rank, world_size)
    eval_sum, eval_count = partial(eval_sampler)
    padded_sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    padded_sum, padded_count = partial(padded_sampler)
    return {
        "n": n,
        "eval_len": len(eval_sampler),
        "eval_local": (float(eval_sum), eval_count),
        "eval_global": global_sum_count(eval_sum, eval_count),
        "eval_indices": all_gather_object(list(eval_sampler)),
        "padded_global": global_sum_count(padded_sum, padded_count),
    }


def check_gradients(rank: int, world_size: int) -> dict[str, Any]:
    from ddp_core.distributed.group import unwrap, wrap_ddp
    from ddp_core.training.seed import seed_everything
    from experiments.toy import ToyModel

    seed_everything(0)  # the same initial weights on every rank
    model = ToyModel()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = wrap_ddp(model, context())
    inputs, targets = global_batch(world_size)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    loss = nn.MSELoss()(ddp(inputs[rows]), targets[rows])
    loss.backward()
    return {
        "type": type(ddp).__name__,
        "initial": initial,
        "grads": {name: p.grad.clone() for name, p in unwrap(ddp).named_parameters()},
    }


def _bucket_model() -> nn.Module:
    from ddp_core.training.seed import seed_everything

    seed_everything(0)  # batch norm (buffers) and dropout (RNG): what the settling pass must leave untouched
    return nn.Sequential(
        nn.Linear(10, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(32, 16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )


def check_bucket_settling(rank: int, world_size: int) -> dict[str, Any]:
    """FirstStepReplay: a run resumed after one step, whose first step runs twice (the first pass undone), ends
    that step with exactly the weights of a run that never stopped, and the experiment's loop sees its batches
    as [first, first, second, ...] with the first pass marked ``active``."""
    import copy

    from ddp_core.training.buckets import FirstStepReplay, rebuilds_buckets
    from ddp_core.training.seed import get_rng_state, set_rng_state

    def ddp(**kwargs: Any) -> nn.parallel.DistributedDataParallel:
        return nn.parallel.DistributedDataParallel(_bucket_model(), bucket_cap_mb=0.001, **kwargs)  # several buckets

    inputs, targets = global_batch(world_size)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    batches = [inputs[rows] * k + k for k in (1, 2, 3)]

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.MSELoss()(model(batch), targets[rows]).backward()  # dropout draws from the global stream
        optimizer.step()

    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    trained = ddp()
    optimizer = sgd(trained)
    train_step(trained, optimizer, batches[0])
    checkpoint = (copy.deepcopy(trained.module.state_dict()), copy.deepcopy(optimizer.state_dict()), get_rng_state())
    for batch in batches[1:]:  # the run that never stopped
        train_step(trained, optimizer, batch)

    resumed = ddp()  # a new process: DDP's first-iteration layout
    resumed_optimizer = sgd(resumed)

    def load() -> None:
        resumed.module.load_state_dict(checkpoint[0])
        resumed_optimizer.load_state_dict(copy.deepcopy(checkpoint[1]))  # as restore() does

    load()
    set_rng_state(checkpoint[2])
    replay = FirstStepReplay(resumed, undo=load)
    seen, active = [], []
    for batch in replay.batches(iter(batches[1:]), per_step=1):
        seen.append(int(batch[0, 0].item() == batches[1][0, 0].item()))
        active.append(replay.active)
        train_step(resumed, resumed_optimizer, batch)
    out = {
        "seen_first": seen,
        "active": active,
        "weights_equal": all(torch.equal(a, b) for a, b in zip(trained.parameters(), resumed.parameters())),
        "buffers_equal": all(torch.equal(a, b) for a, b in zip(trained.buffers(), resumed.buffers())),
        "rebuilt": resumed._has_rebuilt_buckets,
        "decides": rebuilds_buckets(ddp(), world_size),
        "find_unused_skipped": not rebuilds_buckets(ddp(find_unused_parameters=True), 3),
        "plain_model_skipped": not rebuilds_buckets(_bucket_model(), 3),
    }
    return out


GUARD_BAD_STEPS = {1: 7, 2: 5}  # rank -> its first non-finite step; rank 0 stays finite


def check_non_finite_guard(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank raises, naming the earliest bad step of any rank, though rank 0 saw only finite losses."""
    from ddp_core.training.guard import DivergedError, NonFiniteGuard

    guard = NonFiniteGuard(torch.device("cpu"))
    for step in range(1, 9):
        bad = GUARD_BAD_STEPS.get(rank, 0) <= step and rank in GUARD_BAD_STEPS
        guard.observe(torch.tensor(float("nan") if bad else 0.5), step)
    try:
        guard.check(8)
    except DivergedError as error:
        return {"raised": True, "message": str(error)}
    return {"raised": False, "message": ""}


def check_rank_zero_output(rank: int, world_size: int, base_dir: str) -> dict[str, Any]:
    from ddp_core.distributed.group import unwrap, wrap_ddp
    from ddp_core.output.logging import RankZeroWriter
    from ddp_core.training.seed import seed_everything, seed_rank_streams
    from experiments.toy import ToyModel
    from tests.checkpointing import StandInRun, checkpointer

    directory = Path(base_dir) / f"rank{rank}"
    writer = RankZeroWriter(directory)  # enabled=None: decided by the global rank
    for step, value in SCALARS:
        writer.add_scalar("test/loss", value, step)
    writer.add_hparams(HPARAMS, {"hparam/final_loss": FINAL_LOSS}, SCALARS[-1][0])
    writer.close()

    seed_everything(0)
    ddp = wrap_ddp(ToyModel(), context())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = global_batch(world_size)
    nn.MSELoss()(ddp(inputs), targets).backward()
    optimizer.step()  # momentum buffers: the optimizer state is not empty
    seed_rank_streams(0, rank)  # every rank's RNG state differs from here on
    rng_torch = torch.get_rng_state()
    saving = checkpointer(ddp, optimizer, StandInRun(directory), CHECKPOINT_STEP, CHECKPOINT_EPOCH)
    saving.save(CHECKPOINT_STEP)  # a step file and last.pt, as a run writes them
    return {
        "dir": str(directory),
        "enabled": writer.enabled,
        "rng_torch": rng_torch,
        "model": {k: v.clone() for k, v in unwrap(ddp).state_dict().items()},
        "ddp_keys": list(ddp.state_dict()),
    }


def check_console_output(rank: int, world_size: int) -> dict[str, Any]:
    """What print0, the rank-prefixed logger and the progress bar print on each rank."""
    import contextlib
    import io
    import logging

    from ddp_core.output.logging import print0, progress, setup_logging
    from ddp_core.ranks import THIS_RANK

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        setup_logging()  # its handler writes to the (redirected) stdout
        print0(f"print0 from rank {rank}")
        logging.getLogger("check").info("info from rank %d", rank)
        logging.getLogger("check").warning("warning from rank %d", rank)
        logging.getLogger("check").warning("own warning from rank %d", rank, extra=THIS_RANK)
        logging.getLogger("check").error("error from rank %d", rank)
        items = list(progress(range(5), total=5, desc="check"))
    logging.getLogger().handlers.clear()
    return {"stdout": captured.getvalue(), "items": items}


def _section(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    try:
        return {"ok": True, "result": fn(*args)}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()}


def check_agreement(rank: int, world_size: int) -> dict[str, Any]:
    """rank0_decides: rank 0's value, its ConfigError, its StorageError and its bug, as each rank sees them."""
    from ddp_core.distributed.agreement import RankZeroFailed, rank0_decides
    from ddp_core.errors import ConfigError
    from ddp_core.output.storage import StorageError

    ran_on: list[int] = []

    def value() -> dict[str, Any]:
        ran_on.append(rank)
        return {"rank": rank, "tensor": torch.arange(3) * (rank + 1)}

    def outcome(action: Callable[[], Any]) -> dict[str, Any]:
        try:
            return {"returned": rank0_decides(action)}
        except (ConfigError, StorageError, RankZeroFailed) as error:
            return {"type": type(error).__name__, "message": str(error), "agreed": getattr(error, "agreed", None)}
        except ZeroDivisionError as error:
            return {"type": type(error).__name__, "own": True, "message": str(error)}

    def refuse() -> None:
        raise ConfigError(f"refused by rank {rank}")

    def disk_full() -> None:
        raise StorageError(f"disk full on rank {rank}")

    out = {"value": outcome(value), "config": outcome(refuse), "storage": outcome(disk_full)}
    out["bug"] = outcome(lambda: 1 / 0)
    out["ran_on"] = ran_on
    out["after"] = outcome(lambda: "still in step")  # the group is usable after every failure
    return out


def world_checks(rank: int, world_size: int, base_dir: str) -> dict[str, dict[str, Any]]:
    """Every check that needs a working group, in one spawn."""
    return {
        "collectives": _section(check_collectives, rank, world_size),
        "agreement": _section(check_agreement, rank, world_size),
        "samplers": _section(check_samplers, rank, world_size),
        "gradients": _section(check_gradients, rank, world_size),
        "bucket_settling": _section(check_bucket_settling, rank, world_size),
        "non_finite_guard": _section(check_non_finite_guard, rank, world_size),
        "rank_zero_output": _section(check_rank_zero_output, rank, world_size, base_dir),
        "console": _section(check_console_output, rank, world_size),
        "after": {"ok": True, "result": {"rank": dist.get_rank(), "world_size": dist.get_world_size()}},
    }


# ---------------------------------------------------------------- process-group init failures


def try_process_group(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """Form the group from the launch variables; report how it failed (or that it did not)."""
    from ddp_core.distributed.group import DistConfig, process_group

    started = time.monotonic()
    try:
        with process_group(DistConfig(backend="gloo", timeout_s=timeout_s)):
            outcome = {"type": None, "message": ""}
    except Exception as error:
        outcome = {"type": type(error).__name__, "message": str(error), "cause": repr(error.__cause__)}
    outcome["seconds"] = time.monotonic() - started
    outcome["initialized_after"] = dist.is_initialized()
    return outcome


def one_node_cannot_choose(rank: int, world_size: int, failing_rank: int, timeout_s: float) -> dict[str, Any]:
    """Every rank is a node of its own; the node of ``failing_rank`` cannot choose its network interface."""
    import os

    from ddp_core.distributed import network
    from ddp_core.errors import NodeConfigError

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", GROUP_RANK=str(rank))

    def choose(*args, **kwargs):
        if rank == failing_rank:
            raise NodeConfigError("GLOO_SOCKET_IFNAME='eth9': this host has no interface named eth9")
        return None

    network.choose = choose
    return try_process_group(rank, world_size, timeout_s)


# ---------------------------------------------------------------- the harness itself


def fail_on_rank_1(rank: int, world_size: int) -> int:
    """Rank 1 raises while rank 0 waits in a barrier that can never complete."""
    if rank == 1:
        raise ValueError(f"boom on rank {rank} of {world_size}")
    dist.barrier()
    return rank


NOT_YET_S = 1.0  # how long rank 0 watches for a rank that left before it raised (a negative: the wait runs out)


def agreed_error_on_every_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank raises one AgreedConfigError; rank 0 last. The others must not leave before rank 0 printed it."""
    from datetime import timedelta

    from ddp_core.errors import AgreedConfigError, exits_with_one_line

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)
    )

    @exits_with_one_line
    def refuse() -> None:
        raise AgreedConfigError("every rank agreed on this")

    left_before_rank0 = None
    if rank == 0:
        try:
            store.wait([f"left/{r}" for r in range(1, world_size)], timedelta(seconds=NOT_YET_S))
            left_before_rank0 = True
        except dist.DistStoreError:  # nobody left: they wait for rank 0's line
            left_before_rank0 = False
    try:
        refuse()
    except SystemExit as stop:
        code = stop.code
    store.set(f"left/{rank}", "yes")
    return {"code": code, "left_before_rank0": left_before_rank0}


def report_launch_env(rank: int, world_size: int) -> dict[str, Any]:
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    ctx = context()
    return {
        "env": {name: os.environ.get(name) for name in names},
        "ctx": (ctx.rank, ctx.world_size, ctx.backend, str(ctx.device)),
        "group": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
    }
