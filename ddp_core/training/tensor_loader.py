"""Two ways to feed a DDP rank its shard of an in-memory uint8 image dataset: ``ResidentLoader`` (one tensor on the
device, batched augmentation) and ``build_dataloader`` (torchvision's, each sample seeded from (seed, epoch,
index)); both yield float32 (N, C, H, W) images and int64 labels on the device (docs/decisions.md, "CIFAR10")."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from ddp_core.training.seed import loader_generator, worker_init_fn
from ddp_core.training.transfer import upload

Batch = tuple[torch.Tensor, torch.Tensor]


class ResidentLoader:
    """Iterate like a ``DataLoader`` over (N, C, H, W) uint8 images held once on ``device``; ``transform`` turns a
    uint8 batch into a float32 one; ``drop_last`` (training) keeps every rank at the same number of steps."""

    def __init__(
        self,
        images_u8: torch.Tensor,
        labels: torch.Tensor,
        sampler: Sampler[int],
        batch_size: int,
        transform: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device | str = "cpu",
        drop_last: bool = True,
    ):
        if images_u8.dtype != torch.uint8 or images_u8.dim() != 4:
            raise ValueError(f"images_u8 must be uint8 (N, C, H, W), got {images_u8.dtype} {tuple(images_u8.shape)}")
        if len(labels) != len(images_u8):
            raise ValueError(f"{len(images_u8)} images but {len(labels)} labels")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.device = torch.device(device)
        # Contiguous on the device (not before: no host copy), so that index_select reads whole images.
        self.images = images_u8.to(self.device).contiguous()
        self.labels = torch.as_tensor(labels).to(self.device, torch.int64)
        self.sampler, self.batch_size, self.transform, self.drop_last = sampler, batch_size, transform, drop_last

    def __len__(self) -> int:
        return len(self._batches())

    def _batches(self) -> BatchSampler:
        # Lazily, as DataLoader does: TrainSampler's epoch advances when its shard is used up.
        return BatchSampler(self.sampler, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[Batch]:
        for batch_indices in self._batches():
            index = upload(torch.tensor(batch_indices, dtype=torch.int64), self.device)
            yield self.transform(self.images.index_select(0, index)), self.labels.index_select(0, index)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample's augmentation in one epoch (splitmix64-style mixing)."""
    value = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % 2**64
    value ^= value >> 31
    return (value * 0xD6E8FEB86659FD93 % 2**64) >> 1


class SampleSeeds(Sampler[tuple[int, int]]):
    """Yields a sampler's ``(index, seed)``, the seed of (seed, epoch, index) only: the same augmentation whatever
    the workers and resumes."""

    def __init__(self, sampler: Sampler[int], seed: int):
        self.sampler, self.seed = sampler, seed

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = getattr(self.sampler, "epoch", 0)  # read before iterating: TrainSampler advances it at the end
        for index in self.sampler:
            yield index, sample_seed(self.seed, epoch, index)


class ArrayImageDataset(Dataset):
    """Map-style dataset over uint8 (N, H, W, C) images in memory: ``(transform(PIL image), int label)``."""

    def __init__(
        self,
        images_hwc: torch.Tensor | np.ndarray,
        labels: torch.Tensor | Sequence[int],
        transform: Callable[[Any], Any],
    ):
        self.images = images_hwc.numpy() if isinstance(images_hwc, torch.Tensor) else np.asarray(images_hwc)
        self.labels = [int(label) for label in labels]
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ValueError(f"images_hwc must be uint8 (N, H, W, C), got {self.images.dtype} {self.images.shape}")
        if len(self.labels) != len(self.images):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int]:
        """``item``: an index, or ``(index, seed)`` from ``SampleSeeds`` to seed this sample's transform."""
        from PIL import Image  # with torchvision's transforms; not needed by the resident path

        index, seed = item if isinstance(item, tuple) else (item, None)
        image = Image.fromarray(self.images[index])
        if seed is None:
            return self.transform(image), self.labels[index]
        with torch.random.fork_rng(devices=[]):  # torchvision's transforms draw from the global CPU RNG
            torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also seeds CUDA, ~100x slower
            return self.transform(image), self.labels[index]


class DeviceLoader:
    """A DataLoader whose batches arrive on ``device`` (and, optionally, in channels_last format)."""

    def __init__(self, loader: DataLoader, device: torch.device | str, channels_last: bool = False):
        self.loader, self.device, self.channels_last = loader, torch.device(device), channels_last

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __iter__(self) -> Iterator[Batch]:
        non_blocking = self.loader.pin_memory  # only pinned memory copies asynchronously
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        for images, labels in self.loader:
            images = images.to(self.device, non_blocking=non_blocking, memory_format=memory_format)
            yield images, labels.to(self.device, non_blocking=non_blocking)


def build_dataloader(
    dataset: Dataset,
    sampler: Sampler[int],
    batch_size: int,
    device: torch.device | str,
    seed: int,
    rank: int,
    num_workers: int = 0,
    drop_last: bool = True,
    channels_last: bool = False,
) -> DeviceLoader:
    """The textbook DDP input pipeline: a DataLoader with its own generator and workers seeded per global rank
    (docs/design.md, "DataLoader draws"), persistent workers, memory pinned for CUDA."""
    device = torch.device(device)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=SampleSeeds(sampler, seed),
        drop_last=drop_last,
        num_workers=num_workers,
        worker_init_fn=worker_init_fn if num_workers > 0 else None,
        generator=loader_generator(seed, rank),
        persistent_workers=num_workers > 0,
        pin_memory=device.type == "cuda",
    )
    return DeviceLoader(loader, device, channels_last)
