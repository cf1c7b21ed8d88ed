"""Training and evaluation samplers, and exact reduction of evaluation metrics.

``DistributedSampler`` pads an epoch (a sample seen twice) or, with ``drop_last``, skips samples: fine for
training, wrong for evaluation. Evaluate with ``EvalSampler``, which never pads, and ``global_sum_count`` to
combine the ranks' partial sums.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from ddp_core.distributed.collectives import comm_device
from ddp_core.training.seed import fit_seed


class TrainSampler(DistributedSampler):
    """``DistributedSampler`` that cannot be left on the same epoch, and can start mid-epoch at any world size.

    * Every rank draws the same permutation from ``seed + epoch`` and takes every world_size-th index,
      exactly as ``DistributedSampler`` does (so ranks never overlap within an epoch).
    * After a complete pass the epoch advances by itself: forgetting ``set_epoch`` no longer replays
      the same order every epoch. Calling ``set_epoch(e)`` each epoch, as the textbook does, still works.
    * ``set_epoch(epoch, consumed=c)`` deals only the rest of the epoch's permutation, after the ``c``
      samples the whole world already trained on, to this world's ranks. At the world size that trained
      them this is exactly each rank's shard minus its first ``c / world_size`` indices (a bitwise resume);
      at another world size every sample of the epoch is still seen once (docs/decisions.md, "Resuming at
      another world size"). The rest is padded, or cut with ``drop_last``, as ``DistributedSampler`` does.
    """

    def __init__(
        self, num_samples: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False
    ):
        # torch seeds a generator with seed + epoch, which must stay below 2**64: a seed of 2**63 or more
        # (the accepted range is 0..2**64-1) is hashed into 63 bits; smaller seeds are used unchanged.
        seed = fit_seed(seed, 63)
        super().__init__(
            range(num_samples), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.consumed = 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        total = len(self.dataset)  # type: ignore[arg-type]
        if not 0 <= consumed <= total:
            raise ValueError(f"consumed={consumed} must be within the epoch's {total} samples")
        self.epoch = epoch
        self.consumed = consumed

    def _rest(self) -> int:
        """Samples per rank in the rest of the epoch: the same on every rank."""
        rest = len(self.dataset) - self.consumed  # type: ignore[arg-type]
        return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)

    def __len__(self) -> int:
        return self._rest()

    def __iter__(self) -> Iterator[int]:
        total = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:  # DistributedSampler's permutation, so a fresh epoch matches it index for index
            order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(total))
        rest, size = order[self.consumed :], self._rest() * self.num_replicas
        if size > len(rest):  # pad with the epoch's first samples, repeated if the epoch is shorter than the padding
            rest += (order * -(-(size - len(rest)) // max(total, 1)))[: size - len(rest)]
        indices = rest[self.rank : size : self.num_replicas]
        self.consumed = 0
        yield from indices
        self.epoch += 1


class EvalSampler(Sampler[int]):
    """Shard ``range(num_samples)`` over ranks with no padding: rank r gets r, r + W, r + 2W, ...

    Ranks may get different counts (they differ by at most one), so evaluate with the unwrapped model
    (no DDP collectives inside forward) and combine results with ``global_sum_count``.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.indices = range(rank, num_samples, world_size)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


def global_sum_count(total: float | torch.Tensor, count: int | torch.Tensor) -> tuple[float, int]:
    """Sum a metric's (sum, count) over all ranks in float64, so every sample counts exactly once."""
    pair = torch.tensor([float(total), float(count)], dtype=torch.float64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(pair)
    return pair[0].item(), int(round(pair[1].item()))
