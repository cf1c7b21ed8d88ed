"""Synchronized batch norm checks that run inside spawned ranks, and the closed-form inputs the tests share.

Every input is a slice of one global tensor drawn from a fixed seed, so the test process can run plain
BatchNorm on the whole global batch and compare each rank's slice. ``sync_bn_checks`` runs every check
in ONE spawn per world size (a process start costs 2-3 s here).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.harness import context
from tests.distributed.workers import _section

# ---------------------------------------------------------------- closed-form inputs (shared with the tests)

STEPS = 3
# Per-rank batch sizes at each training step. The world of 3 has unequal batches, and one rank with an
# empty batch in the last step (it must still take part in every collective).
BATCH_SIZES = {2: [(4, 4), (4, 4), (4, 4)], 3: [(3, 5, 4), (3, 5, 4), (2, 0, 6)]}
EVAL_SIZES = {2: (3, 3), 3: (2, 4, 3)}
DDP_BATCH_SIZES = {2: (4, 4), 3: (3, 5, 4)}
LR, SGD_MOMENTUM = 0.1, 0.9

# name -> BatchNorm class, its keyword arguments, the input's trailing dims, channels_last or not
CASES: dict[str, tuple[type[nn.Module], dict[str, Any], tuple[int, ...], bool]] = {
    "bn2d": (nn.BatchNorm2d, {"num_features": 4, "momentum": 0.1}, (3, 3), False),
    "bn2d_channels_last": (nn.BatchNorm2d, {"num_features": 4, "momentum": 0.3}, (2, 3), True),
    "bn1d_nc_cumulative": (nn.BatchNorm1d, {"num_features": 5, "momentum": None}, (), False),
    "bn1d_ncl_no_affine": (nn.BatchNorm1d, {"num_features": 3, "affine": False}, (7,), False),
    "bn3d": (nn.BatchNorm3d, {"num_features": 2}, (2, 2, 2), False),
    "bn2d_no_running_stats": (nn.BatchNorm2d, {"num_features": 4, "track_running_stats": False}, (2, 3), False),
}


def bounds(sizes: tuple[int, ...], rank: int) -> slice:
    """Rank r's rows of the global batch: the ranks' batches concatenated in rank order."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def make_bn(case: str) -> nn.Module:
    """The reference BatchNorm of a case, with non-trivial weight and bias (so dL/dx depends on them)."""
    cls, kwargs, _, _ = CASES[case]
    bn = cls(**kwargs)
    if bn.affine:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            bn.weight.copy_(1 + 0.5 * torch.randn(bn.num_features, generator=generator))
            bn.bias.copy_(torch.randn(bn.num_features, generator=generator))
    return bn


def case_data(case: str, sizes: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global input (per-channel offsets and scales, so the statistics matter) and the loss weights w.

    The loss is sum(y * w): its gradient dy = w is not constant, so every term of BatchNorm's backward
    contributes. Each rank's loss is the sum over its slice; the global loss is their sum.
    """
    _, kwargs, trailing, channels_last = CASES[case]
    channels = kwargs["num_features"]
    generator = torch.Generator().manual_seed(1000 + seed)
    shape = (sum(sizes), channels, *trailing)
    per_channel = (1, channels) + (1,) * len(trailing)
    offset = 5 * torch.randn(per_channel, generator=generator)
    scale = 0.5 + 2 * torch.rand(per_channel, generator=generator)
    x = offset + scale * torch.randn(shape, generator=generator)
    w = torch.randn(shape, generator=generator)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, w


def conv_bn_model() -> nn.Sequential:
    """Conv-BN-ReLU feature extractor and a linear head with a cumulative-average BatchNorm1d."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3, bias=False),  # a bias before BatchNorm has a zero gradient: only rounding noise
        nn.BatchNorm1d(3, momentum=None),
    )


def ddp_data(sizes: tuple[int, ...], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    inputs = 2 + 3 * torch.randn(sum(sizes), 3, 5, 5, generator=generator)
    targets = torch.randn(sum(sizes), 3, generator=generator)
    return inputs, targets


def ddp_rank_loss(out: torch.Tensor, targets: torch.Tensor, world_size: int, global_batch: int) -> torch.Tensor:
    """Sum of squared errors over this rank's rows, scaled so that DDP's average over ranks is the mean
    over the global batch (with equal batches this is the mean over the rank's own rows)."""
    return ((out - targets) ** 2).sum() * world_size / global_batch


# ---------------------------------------------------------------- the checks, run on every rank


class _CollectiveCounter(TorchDispatchMode):
    """Counts collectives at the dispatcher, where both kinds arrive: torch.distributed's (``c10d::allgather_``)
    and the functional ones (``_c10d_functional::all_gather_into_tensor``); waiting for a result, or wrapping
    it for autograd, is no collective."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace in ("c10d", "_c10d_functional") and not name.startswith(("wait", "_")):  # _: autograd wrappers
            self.counts[_COLLECTIVE_NAMES.get(name, name)] += 1
        return func(*args, **(kwargs or {}))


# Dispatcher names -> the torch.distributed call they stand for.
_COLLECTIVE_NAMES = {"all_gather_into_tensor": "all_gather", "allgather_": "all_gather", "allreduce_": "all_reduce"}


def _counted(call: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    with _CollectiveCounter() as counter:
        result = call()
    return result, dict(counter.counts)


def check_functional(rank: int, world_size: int) -> dict[str, Any]:
    """Every case: STEPS training steps on this rank's slice, then one eval forward."""
    from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm

    out: dict[str, Any] = {}
    for case, (_, _, _, channels_last) in CASES.items():
        bn = convert_sync_batchnorm(make_bn(case), torch.device("cpu"))
        steps = []
        for step, sizes in enumerate(BATCH_SIZES[world_size]):
            x_global, w_global = case_data(case, sizes, step)
            rows = bounds(sizes, rank)
            x = x_global[rows].clone(memory_format=torch.preserve_format).requires_grad_()
            y, forward_calls = _counted(lambda: bn(x))
            loss = (y * w_global[rows]).sum()
            _, backward_calls = _counted(loss.backward)
            steps.append(
                {
                    "y": y.detach().clone(),
                    "y_channels_last": y.is_contiguous(memory_format=torch.channels_last)
                    if channels_last and y.numel()
                    else None,
                    "x_grad": x.grad.clone(),
                    "weight_grad": None if bn.weight is None else bn.weight.grad.clone(),
                    "bias_grad": None if bn.bias is None else bn.bias.grad.clone(),
                    "forward_calls": forward_calls,
                    "backward_calls": backward_calls,
                }
            )
            bn.zero_grad(set_to_none=True)
        bn.eval()
        x_eval, _ = case_data(case, EVAL_SIZES[world_size], 99)
        eval_y, eval_calls = _counted(lambda: bn(x_eval[bounds(EVAL_SIZES[world_size], rank)]))
        out[case] = {
            "type": type(bn).__name__,
            "steps": steps,
            "state": {k: v.clone() for k, v in bn.state_dict().items()},
            "eval_y": eval_y.detach().clone(),
            "eval_calls": eval_calls,
        }
    return out


def check_ddp_training(rank: int, world_size: int) -> dict[str, Any]:
    """The Conv-BN-ReLU model, converted and DDP-wrapped, trained STEPS SGD steps on this rank's rows."""
    from ddp_core.distributed.group import unwrap, wrap_ddp
    from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm

    torch.manual_seed(0)  # the same initial weights on every rank
    model = conv_bn_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = context()
    ddp = wrap_ddp(convert_sync_batchnorm(model, ctx.device), ctx)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=SGD_MOMENTUM)
    sizes = DDP_BATCH_SIZES[world_size]
    first_grads = None
    for step in range(STEPS):
        inputs, targets = ddp_data(sizes, step)
        rows = bounds(sizes, rank)
        ddp_rank_loss(ddp(inputs[rows]), targets[rows], world_size, sum(sizes)).backward()
        if first_grads is None:
            first_grads = {name: p.grad.clone() for name, p in unwrap(ddp).named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "types": [type(m).__name__ for m in unwrap(ddp)],
        "initial": initial,
        "first_grads": first_grads,
        "final": {k: v.clone() for k, v in unwrap(ddp).state_dict().items()},
    }


# Values per channel of each rank where the global batch has too few: one rank holds one, the rest none.
TOO_FEW = {2: (1, 0), 3: (0, 1, 0)}


def check_too_few_values(rank: int, world_size: int) -> str:
    """BatchNorm's "more than 1 value per channel" over the global batch: the error every rank raises."""
    from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm

    bn = convert_sync_batchnorm(nn.BatchNorm1d(3), torch.device("cpu"))
    try:
        bn(torch.randn(TOO_FEW[world_size][rank], 3))
    except ValueError as error:
        return str(error)
    return "no error"


def sync_bn_checks(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {
        "functional": _section(check_functional, rank, world_size),
        "ddp": _section(check_ddp_training, rank, world_size),
        "too_few": _section(check_too_few_values, rank, world_size),
    }


# ---------------------------------------------------------------- torch.compile (a world of 2 is enough)

COMPILE_MODELS = ("small", "resnet18")


def _explain(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    return {
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "reasons": [reason.reason.splitlines()[0] for reason in explained.break_reasons],
        "global_bn_layers": sum(type(m).__name__ == "GlobalBatchNorm" for m in model.modules()),
    }


def _layers_compiled_inside_ddp(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """The experiment's ``compile_forward`` of the model wrapped in DDP as ``run.wrap`` wraps it, one training step:
    how many of its convolutions the compiled graphs hold (dynamo's graphs, counted by a backend that runs them as
    traced)."""
    import torch._dynamo
    import torch.distributed as dist

    from ddp_core.distributed.env import DistEnv
    from ddp_core.distributed.group import DistContext, wrap_ddp
    from experiments.cifar10_models import compile_forward

    graphs: list[torch.fx.GraphModule] = []

    def counting(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    real_compile = torch.compile
    torch.compile = lambda module, **options: real_compile(module, backend=counting)  # the experiment's own call
    try:
        env = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size())
        wrapped = wrap_ddp(model, DistContext(env=env, backend="gloo", device=torch.device("cpu")))
        forward = compile_forward(wrapped, compile=True, cuda_graphs=False)
    finally:
        torch.compile = real_compile
    forward(x).sum().backward()
    traced = [node for graph in graphs for node in graph.graph.nodes if node.op in ("call_function", "call_module")]
    return {
        "convolutions": sum(isinstance(module, nn.Conv2d) for module in model.modules()),
        "compiled_convolutions": sum("conv" in str(getattr(node.target, "__name__", node.target)) for node in traced),
        "graphs": len(graphs),
    }


def _forward_backward(
    forward: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, x: torch.Tensor
) -> dict[str, torch.Tensor]:
    out = forward(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    results = {"out": out.detach().clone()}
    results.update({f"grad.{name}": p.grad.clone() for name, p in model.named_parameters()})
    results.update({f"buffer.{name}": b.clone() for name, b in model.named_buffers()})
    return results


def compile_checks(rank: int, world_size: int) -> dict[str, Any]:
    """The CIFAR models with GlobalBatchNorm: dynamo's graph breaks in training mode, and one compiled
    training step (forward and backward, through AOTAutograd) against the same step run eagerly."""
    import copy

    from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm
    from experiments.cifar10_models import build_model

    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(100 + rank))  # every rank its own batch
    out: dict[str, Any] = {}
    for name in COMPILE_MODELS:
        torch.manual_seed(0)
        out[name] = _explain(convert_sync_batchnorm(build_model(name), torch.device("cpu")), x)
    torch.manual_seed(0)  # the small CNN only: ResNet-18 takes seconds more to trace, and what differs is the frame
    out["small"]["inside_ddp"] = _layers_compiled_inside_ddp(
        convert_sync_batchnorm(build_model("small"), torch.device("cpu")), x
    )
    torch.manual_seed(0)
    eager = convert_sync_batchnorm(build_model("small"), torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    # aot_eager: dynamo and AOTAutograd trace forward and backward (the collectives included) without
    # needing a C++ compiler; inductor only changes the kernels.
    out["compiled_step"] = _forward_backward(torch.compile(compiled, backend="aot_eager", fullgraph=True), compiled, x)
    out["eager_step"] = _forward_backward(eager, eager, x)
    return out
