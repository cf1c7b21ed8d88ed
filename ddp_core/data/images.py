"""Images as uint8 (N, H, W, C) arrays: two input pipelines sharded by the same ``TrainSampler``, ``tensor``
(resident on the device, batched augmentation) and ``torchvision`` (the textbook reference, 12x to 26x slower:
docs/benchmarks.md); pictures for TensorBoard; generated stand-ins. torchvision is imported late (docs/design.md)."""

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
    """Training batches of this rank's shard, normalised, on ``device``; partial batches dropped. ``num_workers``,
    ``seed`` and ``rank`` are the torchvision DataLoader's; the tensor pipeline draws from ``device``'s global RNG."""
    check_pipeline(pipeline)
    padding = padding if augment else 0
    if pipeline == "tensor":
        transform = batch_transform(*norm, padding=padding, flip_p=0.5 if augment else 0.0, channels_last=channels_last)
        return ResidentLoader(
            images.permute(0, 3, 1, 2), labels, sampler, batch_size, transform, device, drop_last=True
        )
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
    """Evaluation batches of this rank's ``EvalSampler`` shard, unpadded (combine with ``global_sum_count``);
    build once: the tensor pipeline keeps the test set resident on ``device``."""
    check_pipeline(pipeline)
    sampler = EvalSampler(len(labels), rank, world_size)
    if pipeline == "tensor":
        transform = batch_transform(*norm, channels_last=channels_last)
        return ResidentLoader(
            images.permute(0, 3, 1, 2), labels, sampler, batch_size, transform, device, drop_last=False
        )
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
    [[230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48]]
    + [[145, 30, 180], [70, 240, 240], [240, 50, 230], [128, 128, 0], [250, 190, 190]],
    dtype=np.float32,
)


def learnable_images(n: int, seed: int = 0, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """n uint8 (n, size, size, 3) images of 10 balanced classes a small CNN learns in an epoch or two: class c is
    ``PALETTE[c]`` in stripes, horizontal for even c, of a period by c // 2, cues that crops and flips keep."""
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
