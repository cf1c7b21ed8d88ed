"""Images as uint8 (N, H, W, C) arrays: the two input pipelines, pictures for TensorBoard, generated stand-ins.

Two pipelines turn them into training batches, both sharded by the same ``TrainSampler`` (so the same seed, epoch
and rank give the same samples; see ``ddp_core.training.tensor_loader``):

* ``tensor`` (default): the dataset resident on the device as one tensor; crop, flip and normalise are
  batched tensor operations (``ddp_core.training.augment``) drawing from torch's global RNG, which the
  checkpoint's RNG state restores for a bitwise resume.
* ``torchvision``: Dataset + DataLoader + PIL transforms, the textbook reference (12x to 26x slower on CPU:
  docs/benchmarks.md).

torchvision is imported only inside the functions that need it: importing it costs about 1.8x
``import torch`` (docs/design.md, "Import cost of torchvision").
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch

from ddp_core.errors import ConfigError
from ddp_core.training.augment import batch_transform
from ddp_core.training.samplers import EvalSampler, TrainSampler
from ddp_core.training.tensor_loader import (
    ArrayImageDataset,
    DeviceLoader,
    ResidentLoader,
    build_dataloader,
    hwc_to_chw,
)

Pipeline = Literal["tensor", "torchvision"]
PIPELINES: tuple[str, ...] = ("tensor", "torchvision")
Norm = tuple[Sequence[float], Sequence[float]]  # each channel's mean and standard deviation


def torchvision_transform(norm: Norm, size: int = 0, padding: int = 0, flip: bool = False) -> Any:
    """ToTensor and Normalize, after RandomCrop(size, padding) and a flip when asked: the textbook transform."""
    from torchvision import transforms

    augment = [transforms.RandomCrop(size, padding=padding)] if padding else []
    augment += [transforms.RandomHorizontalFlip()] if flip else []
    return transforms.Compose([*augment, transforms.ToTensor(), transforms.Normalize(*norm)])


def check_pipeline(pipeline: str) -> None:
    if pipeline not in PIPELINES:
        raise ConfigError(f"input pipeline {pipeline!r} is not one of {', '.join(PIPELINES)}")


def train_loader(
    images: torch.Tensor,
    labels: torch.Tensor,
    sampler: TrainSampler,
    batch_size: int,
    pipeline: Pipeline = "tensor",
    device: torch.device | str = "cpu",
    num_workers: int = 0,
    seed: int = 0,
    rank: int = 0,
    augment: bool = True,
    channels_last: bool = False,
    *,
    norm: Norm,
    padding: int,
) -> ResidentLoader | DeviceLoader:
    """Training batches of this rank's shard: (float32 (B, C, H, W) normalised, int64 (B,)) on ``device``.

    Partial batches are dropped, so every rank runs the same number of steps. ``num_workers``, ``seed``
    and ``rank`` concern the torchvision pipeline's DataLoader (its generator and worker seeds); the
    tensor pipeline draws crops (``padding``) and flips from the global RNG of ``device``, which
    ``seed_rank_streams`` makes per rank and the checkpoint's RNG state restores. ``augment=False`` turns crop
    and flip off (normalisation only), in both pipelines.
    """
    check_pipeline(pipeline)
    padding = padding if augment else 0
    if pipeline == "tensor":
        transform = batch_transform(*norm, padding=padding, flip_p=0.5 if augment else 0.0, channels_last=channels_last)
        return ResidentLoader(hwc_to_chw(images), labels, sampler, batch_size, transform, device, drop_last=True)
    dataset = ArrayImageDataset(images, labels, torchvision_transform(norm, images.shape[1], padding, augment))
    return build_dataloader(
        dataset, sampler, batch_size, device, seed, rank, num_workers, drop_last=True, channels_last=channels_last
    )


def eval_batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    rank: int,
    world_size: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    pipeline: Pipeline = "tensor",
    num_workers: int = 0,
    channels_last: bool = False,
    *,
    norm: Norm,
) -> ResidentLoader | DeviceLoader:
    """Evaluation batches of this rank's ``EvalSampler`` shard (no padding, no augmentation, normalised).

    Ranks may get one sample more or less than each other: combine metrics with ``global_sum_count``.
    The tensor pipeline keeps the test set resident on ``device``: build this once and iterate it every
    evaluation.
    """
    check_pipeline(pipeline)
    sampler = EvalSampler(len(labels), rank, world_size)
    if pipeline == "tensor":
        transform = batch_transform(*norm, channels_last=channels_last)
        return ResidentLoader(hwc_to_chw(images), labels, sampler, batch_size, transform, device, drop_last=False)
    dataset = ArrayImageDataset(images, labels, torchvision_transform(norm))
    return build_dataloader(
        dataset, sampler, batch_size, device, 0, rank, num_workers, drop_last=False, channels_last=channels_last
    )


def unnormalise(images: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Normalised (N, C, H, W) images -> float pictures in [0, 1] on the CPU, as they looked before."""
    images = images.detach().float().cpu()
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) for values in norm)
    return (images * std + mean).clamp(0, 1)


def image_grid(images: torch.Tensor, norm: Norm, columns: int = 8, border: int = 2) -> torch.Tensor:
    """Normalised (N, C, H, W) images -> one float (C, H', W') picture in [0, 1] for TensorBoard's add_image."""
    pictures = unnormalise(images, norm)
    n, channels, height, width = pictures.shape
    rows = -(-n // columns)
    columns = min(columns, n)
    canvas = torch.ones(channels, rows * (height + border) + border, columns * (width + border) + border)
    for i, picture in enumerate(pictures):  # at most a few dozen images, once per run
        top, left = border + (i // columns) * (height + border), border + (i % columns) * (width + border)
        canvas[:, top : top + height, left : left + width] = picture
    return canvas


def as_uint8_hwc(
    images: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray | Sequence[int], shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """numpy arrays of uint8 images of ``shape`` (H, W, C) and their labels, or a ValueError saying what differs."""
    images = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    labels = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if images.dtype != np.uint8 or images.shape[1:] != shape:
        raise ValueError(f"images must be uint8 (N, {', '.join(map(str, shape))}), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),):
        raise ValueError(f"{len(images)} images but labels of shape {labels.shape}")
    return images, labels


# Colours of the synthetic classes: far apart in RGB, so colour alone separates them despite the noise.
PALETTE = np.array(
    [
        [230, 25, 75],
        [60, 180, 75],
        [255, 225, 25],
        [0, 130, 200],
        [245, 130, 48],
        [145, 30, 180],
        [70, 240, 240],
        [240, 50, 230],
        [128, 128, 0],
        [250, 190, 190],
    ],
    dtype=np.float32,
)


def learnable_images(n: int, seed: int = 0, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """n synthetic uint8 (n, size, size, 3) images of 10 classes, with int64 labels, that a small CNN learns in an
    epoch or two: a stand-in for a real dataset, in tests and without internet.

    Class c: colour ``PALETTE[c]`` modulated by stripes that are horizontal for even c and vertical for
    odd c, with a period of 4, 6, 8, 12 or 16 pixels (by c // 2), at a random phase, with random
    brightness and pixel noise. Crop shifts and horizontal flips keep every cue (stripe orientation and
    period, colour), so augmentation does not hide the class. Labels are balanced and shuffled.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(PALETTE))
    period = np.array([4, 6, 8, 12, 16], dtype=np.float32)[labels // 2]
    phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)
    coordinate = np.arange(size, dtype=np.float32)
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * coordinate[None, :] / period[:, None] + phase[:, None])  # (n, size)
    horizontal = (labels % 2 == 0)[:, None, None]
    stripes = np.where(horizontal, wave[:, :, None], wave[:, None, :])  # (n, size, size): rows or columns vary
    brightness = rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32)
    images = PALETTE[labels][:, None, None, :] * brightness * (0.5 + 0.5 * stripes[..., None])
    images += rng.normal(0, 16, images.shape).astype(np.float32)
    return torch.from_numpy(np.clip(images, 0, 255).round().astype(np.uint8)), torch.from_numpy(labels.astype(np.int64))
