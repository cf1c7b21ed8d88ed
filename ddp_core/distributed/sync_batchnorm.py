"""Synchronized batch norm on CPU/gloo too: torch's ``nn.SyncBatchNorm`` refuses CPU tensors, so ``GlobalBatchNorm``
stands in there (docs/decisions.md, "CIFAR10")."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddp_core.distributed.env import healing
from ddp_core.errors import ConfigError

SYNC_BN_IMPLS = ("torch", "global")
# --heal (lifecycle/heal.py): told of a collective that failed (a peer died), after which the step is abandoned; the
# layers go on with their own batch's statistics, the group being closed. None: a failure raises, as torch's.
on_failure: Callable[[Exception], None] | None = None


def _collective(result: Callable[[], torch.Tensor], own: torch.Tensor) -> torch.Tensor:
    """``result()``, waited for; under --heal, ``own`` where it failed."""
    if on_failure is None:
        return result()
    try:
        return result() + 0  # waits: an asynchronous collective's error surfaces here
    except Exception as error:  # gloo's "connection closed", a group already closed
        on_failure(error)
        return own


def _check_enough_values(local_count: int, total: torch.Tensor, world: int) -> None:
    """BatchNorm's "more than 1 value per channel" for the global batch: only a rank holding 0 or 1 values reads
    the global count (a host sync); when the total is at most 1, every rank holds at most 1, so all agree."""
    if local_count > 1:
        return
    got = int(total.item())
    if got <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {got} across {world} ranks")


class _GlobalBatchNormFunction(torch.autograd.Function):
    """Batch norm over the union of every rank's batch; the backward is that of BatchNorm on the global batch."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor):  # type: ignore[override]
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]  # every dimension but channels; any memory format (channels_last too)
        shape = [1, channels] + [1] * (x.dim() - 2)
        compute = torch.promote_types(x.dtype, torch.float32)  # half/bfloat16 statistics in float32
        count = x.numel() // channels if channels else 0

        # Per rank: count, mean and M2 = sum((x - mean)^2), combined with Chan's parallel formula in
        # float64. Unlike sum and sum of squares this does not cancel catastrophically when |mean| >> std,
        # and unlike an all_reduce of means it weights ranks by their own counts (batch sizes may differ).
        if count > 0:
            var, mean = torch.var_mean(x.to(compute), dim=dims, correction=0)
        else:  # an empty batch contributes nothing but must still take part in the collective
            var = mean = x.new_zeros(channels, dtype=compute)
        local = torch.cat([x.new_full((1,), count, dtype=torch.float64), mean.double(), var.double() * count])
        world = dist.get_world_size()
        # One collective, and a functional one: torch.compile traces it into the graph (dist.all_gather
        # into a list would break the graph at every BatchNorm layer).
        gathered = _collective(lambda: funcol.all_gather_single(local, 0, dist.group.WORLD), local.repeat(world))
        gathered = gathered.view(world, local.numel())
        counts, means, m2s = gathered.split([1, channels, channels], dim=1)
        total = counts.sum()  # a device tensor: reading it on the host would sync the GPU once per layer
        _check_enough_values(count, total, world)
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)

        if running_mean is not None:  # exactly BatchNorm's update, with the unbiased variance of the global batch
            running_mean.copy_((1 - factor) * running_mean.double() + factor * global_mean)
            running_var.copy_((1 - factor) * running_var.double() + factor * global_m2 / (total - 1))

        mean = global_mean.to(compute)
        invstd = torch.rsqrt(global_m2 / total + eps).to(compute)
        y = (x.to(compute) - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.to(compute).view(shape) + bias.to(compute).view(shape)
        # x_hat is recomputed in backward rather than saved: one input-sized tensor less held per layer.
        ctx.save_for_backward(x, weight, mean, invstd, total)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        x, weight, mean, invstd, total = ctx.saved_tensors
        channels, compute = x.shape[1], mean.dtype
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        dy = grad_output.to(compute)
        x_hat = (x.to(compute) - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims)  # zeros on an empty batch, which is what the global sums need from it
        sum_dy_xhat = (dy * x_hat).sum(dims)

        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # dL/dx depends on every rank's dy through the shared mean and variance: global sums, one
            # all_reduce of both packed together.
            own = torch.cat([sum_dy, sum_dy_xhat])
            sums = _collective(lambda: funcol.all_reduce(own, "sum", dist.group.WORLD), own)
            global_dy, global_dy_xhat = (sums / total.to(compute)).view(2, *shape).unbind(0)
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_input = (scale.view(shape) * (dy - global_dy - x_hat * global_dy_xhat)).to(x.dtype)
        # Local sums, like torch's SyncBatchNorm: DDP's gradient all-reduce averages them over ranks.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm over (N, C, *) whose training statistics are those of every rank's batch; BatchNorm's parameters,
    buffers and state_dict keys. Only training mode synchronises, as in torch's SyncBatchNorm."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, *), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return super().forward(input)  # _BatchNorm.forward: F.batch_norm, bit for bit
        self._check_input_dim(input)
        # BatchNorm's momentum handling: momentum=None means a cumulative average over batches.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a device tensor: float() of it would sync the GPU
                factor = 1.0 / self.num_batches_tracked.double()
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _GlobalBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor
        )


def _to_global(module: nn.Module) -> nn.Module:
    """Every _BatchNorm below ``module`` replaced by a GlobalBatchNorm holding the same tensors (torch's recipe)."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, GlobalBatchNorm):
        converted = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        # The same Parameter and buffer objects, not copies: values, device, dtype and requires_grad
        # carry over, and an optimizer built before the conversion still points at them.
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
    for name, child in module.named_children():
        converted.add_module(name, _to_global(child))
    return converted


def convert_sync_batchnorm(module: nn.Module, device: torch.device | str, impl: str | None = None) -> nn.Module:
    """BatchNorm layers synchronised across ranks, before the DDP wrap: ``impl`` "torch" (CUDA only) or "global";
    None: torch's on CUDA. Use the return value (a new object when ``module`` is itself a BatchNorm)."""
    is_cuda = torch.device(device).type == "cuda"
    impl = impl or ("torch" if is_cuda and not healing() else "global")
    if impl == "torch" and healing():
        raise ConfigError("--heal cannot carry torch's SyncBatchNorm (its collectives cannot fail softly): use global")
    if impl not in SYNC_BN_IMPLS:
        raise ValueError(f"sync batch norm implementation {impl!r}: use one of {', '.join(SYNC_BN_IMPLS)}")
    if impl == "torch":
        if not is_cuda:
            raise ValueError("torch's SyncBatchNorm only works on CUDA tensors: use impl='global' on this device")
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _to_global(module)
