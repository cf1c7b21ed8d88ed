"""The bytes DDP hands to all-reduce on this rank, counted on the tensors it sends.

- With a communication hook (fp16, bf16, PowerSGD): torch's hooks call ``torch.distributed.all_reduce`` through
  their module's name ``dist``, PowerSGD's P and Q factors from the future chain after the hook has returned (on
  a gloo thread). So those two modules' ``dist`` becomes a proxy that adds each tensor's bytes and hands the call
  on unchanged: the compressed buffer for fp16/bf16; P, Q and the tensors sent whole for PowerSGD (and the whole
  bucket in its plain steps). Nothing else calls through that name: the run's own collectives are not counted.
- Without a hook (``none``): DDP's built-in all-reduce sends its buckets whole, once per backward pass that
  synchronizes. No hook is registered to count them: torch's own ``allreduce_hook``, registered for ``none``,
  ends elsewhere in the last bits at 3 ranks (tests/distributed/test_step_time.py fails with it). The bytes
  are the buckets' sizes as DDP records them, counted per such pass (``StepTimer``'s ``on_synced_pass``).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import torch
from torch import nn


class SentBytes:
    """A running total, added to from the training thread and from the threads that run futures' callbacks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, count: int) -> None:
        with self._lock:
            self._total += count

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


HOOKS_SENT = SentBytes()  # every all-reduce of torch's DDP hooks in this process (one DDP model per process)


class _CountingDist:
    """``torch.distributed`` as a hook module sees it, with ``all_reduce`` counting what it is handed."""

    def __init__(self, module: ModuleType, sent: SentBytes) -> None:
        self._module, self._sent = module, sent

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._sent.add(tensor.numel() * tensor.element_size())
        return self._module.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def count_hook_all_reduces() -> SentBytes:
    """Count, from now on, what torch's DDP communication hooks hand to all-reduce (once per process)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    for module in (default_hooks, powerSGD_hook):
        if not isinstance(module.dist, _CountingDist):
            module.dist = _CountingDist(module.dist, HOOKS_SENT)  # type: ignore[assignment]
    return HOOKS_SENT


def bucket_bytes(model: nn.parallel.DistributedDataParallel) -> int:
    """The bytes of DDP's gradient buckets, as its logger records them ("660" or "220, 440")."""
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(size) for size in str(sizes).split(",") if size.strip())
