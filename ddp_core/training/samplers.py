"""Training and evaluation samplers, and exact reduction of evaluation metrics: ``DistributedSampler`` pads or
drops samples, wrong for evaluation, so ``EvalSampler`` never pads and ``global_sum_count`` combines the ranks."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from ddp_core.distributed.collectives import comm_device
from ddp_core.training.seed import fit_seed


class TrainSampler(DistributedSampler):
    """``DistributedSampler``'s permutation and strided shards, whose epoch advances by itself after a full pass;
    ``set_epoch(epoch, consumed=c)`` deals the rest of the epoch after ``c`` samples to this world's ranks
    (docs/decisions.md, "Resuming at another world size"). E.g. 10 samples, 3 ranks, no shuffle: [0, 3, 6, 9],
    [1, 4, 7, 0], [2, 5, 8, 1]; with ``drop_last`` [0, 3, 6], [1, 4, 7], [2, 5, 8]."""

    def __init__(
        self, num_samples: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False
    ):
        # torch's seed + epoch must stay below 2**64: a seed of 2**63 or more is hashed into 63 bits.
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

    def __len__(self) -> int:
        """Samples per rank in the rest of the epoch: the same on every rank."""
        rest = len(self.dataset) - self.consumed  # type: ignore[arg-type]
        return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        total = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:  # DistributedSampler's permutation, so a fresh epoch matches it index for index
            order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(total))
        rest, size = order[self.consumed :], len(self) * self.num_replicas
        if size > len(rest):  # pad with the epoch's first samples, repeated if the epoch is shorter than the padding
            rest += (order * -(-(size - len(rest)) // max(total, 1)))[: size - len(rest)]
        indices = rest[self.rank : size : self.num_replicas]
        self.consumed = 0
        yield from indices
        self.epoch += 1


class EvalSampler(Sampler[int]):
    """Shard ``range(num_samples)`` with no padding: rank r gets r, r + W, ...; counts differ by up to one, so
    evaluate the unwrapped model and combine with ``global_sum_count``."""

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
