"""DDP's own communication knobs, chosen by flags: a gradient-compression hook (fp16, bf16, PowerSGD, whose
per-rank state the checkpoint holds), the bytes it sends, and the optimizer state sharded (``--zero``)
(docs/decisions.md, "DDP's knobs in the resume" and "Where the time and the bytes go")."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ddp_core.config import option
from ddp_core.errors import AgreedConfigError
from ddp_core.training.transfer import to_host

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
_POWERSGD_STATE = ("error_dict", "p_memory_dict", "q_memory_dict")


@dataclass
class CommArgs:
    """DDP's communication knobs: what its all-reduce sends, its buckets, and the optimizer state sharded."""

    comm_hook: str = option(
        "none", "gradient compression in DDP's all-reduce (docs/experiments.md)", choices=COMM_HOOKS
    )
    powersgd_rank: int = option(1, "PowerSGD's approximation rank (--comm-hook powersgd)", minimum=1, maximum=1024)
    powersgd_start_step: int = option(
        10, "plain all-reduce for this many optimizer steps before PowerSGD compresses", minimum=2, maximum=2**31
    )
    zero: bool = option(
        False, "shard the optimizer state across the ranks (ZeroRedundancyOptimizer)", computation=False
    )
    bucket_cap_mb: float = option(25.0, "DDP's gradient bucket size, in MiB", above=0, maximum=2**20)
    static_graph: bool = option(False, "tell DDP the model runs the same graph every step")
    gradient_as_bucket_view: bool = option(
        False, "gradients as views into DDP's buckets (less memory)", computation=False
    )


def ddp_knobs_set(args: CommArgs) -> bool:
    """Whether a flag asks for one of DDP's own behaviours (its hook, buckets, static graph, bucket views)."""
    default = CommArgs()
    knobs = ("comm_hook", "bucket_cap_mb", "static_graph", "gradient_as_bucket_view")
    return any(getattr(args, knob) != getattr(default, knob) for knob in knobs)


class CommHook:
    """The hook registered on one DDP model, and the state a checkpoint holds for it (PowerSGD's; none otherwise)."""

    def __init__(self, name: str, rank: int = 1, start_step: int = 2) -> None:
        if name not in COMM_HOOKS:
            raise ValueError(f"comm hook {name!r}: use one of {', '.join(COMM_HOOKS)}")
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # imported where used: it is slow

        self.name = name
        self.powersgd: Any = None  # powerSGD_hook.PowerSGDState
        if name == "powersgd":
            # start_powerSGD_iter counts DDP iterations (one per optimizer step without accumulation);
            # min_compression_rate=2: a matrix too small to gain is sent whole, as torch's default.
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_step
            )
        self._bucket_bytes = 0  # what one synchronizing pass sends of DDP's buckets (PowerSGD: in a plain step)
        self._element_size = 4  # of the gradients: PowerSGD's factors and the tensors it sends whole
        self._numel_seen = 0  # PowerSGD's total_numel_after_compression at the last pass counted
        self.sent_bytes = 0  # handed to all-reduce for the gradients since ``register``, by this rank
        self.device = torch.device("cpu")  # the model's, once registered: where a loaded state goes

    @property
    def stateful(self) -> bool:
        return self.powersgd is not None

    def register(self, model: nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        parameter = next(model.parameters())
        self.device, self._element_size = parameter.device, parameter.element_size()
        sizes = model._get_ddp_logging_data().get("bucket_sizes", "")  # bytes per bucket: "660" or "220, 440"
        self._bucket_bytes = sum(int(size) for size in str(sizes).split(",") if size.strip())
        if self.name in ("fp16", "bf16"):  # the buckets cast to 2-byte floats
            self._bucket_bytes = self._bucket_bytes // self._element_size * 2
            model.register_comm_hook(None, getattr(default_hooks, f"{self.name}_compress_hook"))
        elif self.powersgd is not None:
            model.register_comm_hook(self.powersgd, powerSGD_hook.powerSGD_hook)

    def count_pass(self) -> None:
        """Count a pass in which DDP all-reduced the gradients: its buckets, or what PowerSGD's state counted."""
        numel = self.powersgd.total_numel_after_compression if self.powersgd is not None else self._numel_seen
        sent = self._bucket_bytes if numel == self._numel_seen else (numel - self._numel_seen) * self._element_size
        self.sent_bytes += sent
        self._numel_seen = numel

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's hook state as CPU tensors and plain values (loads weights-only); None without state."""
        if self.powersgd is None:
            return None
        state = self.powersgd
        _, key, pos, has_gauss, gauss = state.rng.get_state()
        saved = {
            name: {i: t.detach().cpu().clone() for i, t in getattr(state, name).items()} for name in _POWERSGD_STATE
        }
        rng = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "gauss": [int(has_gauss), float(gauss)]}
        numel = [state.total_numel_before_compression, state.total_numel_after_compression]
        return {**saved, "iter": state.iter, "rng": rng, "numel": numel}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Put this rank's saved state back into the registered hook; None: the error feedback starts afresh."""
        if self.powersgd is None:
            return
        if saved is None:
            self.reset()
            return
        state, device = self.powersgd, self.device
        for name in _POWERSGD_STATE:
            target = getattr(state, name)
            target.clear()
            target.update({int(i): t.to(device).clone() for i, t in saved[name].items()})
        state.iter = int(saved["iter"])
        rng = saved["rng"]
        state.rng.set_state(("MT19937", rng["key"].numpy().astype(np.uint32), rng["pos"], *rng["gauss"]))
        state.total_numel_before_compression, state.total_numel_after_compression = saved["numel"]
        self._numel_seen = state.total_numel_after_compression

    def reset(self) -> None:
        """Forget this rank's error feedback and warm start (a continuation at another world size)."""
        if self.powersgd is not None:
            for name in _POWERSGD_STATE:
                getattr(self.powersgd, name).clear()

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """Plain all-reduce while inside (PowerSGD's state untouched): for a step that is undone afterwards."""
        if self.powersgd is None:
            yield
            return
        start, self.powersgd.start_powerSGD_iter = self.powersgd.start_powerSGD_iter, 2**62
        try:
            yield
        finally:
            self.powersgd.start_powerSGD_iter = start


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``ZeroRedundancyOptimizer`` with ``optimizer``'s groups and settings; stepping ``optimizer`` is refused."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    first, *rest = optimizer.param_groups
    accepted = inspect.signature(type(optimizer)).parameters  # a group also holds keys its class sets itself
    settings = {key: value for key, value in first.items() if key != "params" and key in accepted}
    sharded = ZeroRedundancyOptimizer(first["params"], optimizer_class=type(optimizer), **settings)
    for group in rest:
        sharded.add_param_group(dict(group))
    optimizer.register_step_pre_hook(_stepped_after_sharding)
    return sharded


class ShardedOptimizerState:
    """``--zero``'s optimizer as a sharded part of the checkpoint: each rank's share keyed by parameter index, joined
    on rank 0 into ``ZeroRedundancyOptimizer.state_dict``'s layout, which loads at any world size."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[int, Any]:
        local = self.optimizer.optim  # type: ignore[attr-defined]
        every = (param for group in self.optimizer.param_groups for param in group["params"])
        indices = {param: index for index, param in enumerate(every)}
        params = [param for group in local.param_groups for param in group["params"]]
        saved = local.state_dict()["state"]  # keyed by the position in ``params``
        return {indices[params[i]]: to_host(value) for i, value in saved.items()}

    def join(self, shares: list[dict[int, Any]]) -> dict[str, Any]:
        """The whole optimizer's state dict from every rank's share (rank 0, while saving)."""
        groups, start = [], 0
        for group in self.optimizer.param_groups:
            settings = {key: value for key, value in group.items() if key != "params"}
            groups.append({**settings, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        state = {index: value for share in shares for index, value in share.items()}
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def _stepped_after_sharding(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # The checkpoint holds the sharded optimizer's state, which would never move. Every rank raises this together.
    raise AgreedConfigError(
        f"--zero: this {type(optimizer).__name__} was sharded; step the optimizer of the loop that "
        "plan.resume_or_start(...) returned (optimizer = loop.optimizer)"
    )
