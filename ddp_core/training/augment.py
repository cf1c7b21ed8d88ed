"""Batched augmentation of uint8 (N, C, H, W) images: torchvision's RandomCrop, RandomHorizontalFlip, ToTensor and
Normalize per image, with no Python loop. Draws come from ``generator`` or the device's global RNG, which the
checkpoint restores; ``offsets=``/``mask=`` apply chosen decisions instead."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

BatchTransform = Callable[[torch.Tensor], torch.Tensor]


def _check_batch(images: torch.Tensor, name: str) -> None:
    if images.dim() != 4:
        raise ValueError(f"{name} needs a batch of shape (N, C, H, W), got shape {tuple(images.shape)}")


def draw_crop_offsets(
    n: int, padding: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> torch.Tensor:
    """(n, 2) int64 (top, left) offsets, uniform in 0..2*padding, as torchvision's RandomCrop draws them."""
    return torch.randint(0, 2 * padding + 1, (n, 2), device=device, generator=generator)


def crop(images: torch.Tensor, padding: int, offsets: torch.Tensor) -> torch.Tensor:
    """Crop each image of the zero-padded batch at its (top, left) offset; same shape as ``images``."""
    _check_batch(images, "crop")
    if padding < 0:
        raise ValueError(f"padding={padding} must be >= 0")
    n, _, height, width = images.shape
    if offsets.shape != (n, 2):
        raise ValueError(f"offsets must have shape ({n}, 2), got {tuple(offsets.shape)}")
    if padding == 0:
        return images.clone()  # a crop always returns new memory; callers may write into it
    padded = F.pad(images, (padding, padding, padding, padding))  # constant zeros
    # windows[n, c, top, left] is the (H, W) view of image n at that offset: no copy until indexed.
    windows = padded.unfold(2, height, 1).unfold(3, width, 1)
    offsets = offsets.to(images.device)
    return windows[torch.arange(n, device=images.device), :, offsets[:, 0], offsets[:, 1]]


def random_crop(
    images: torch.Tensor, padding: int, generator: torch.Generator | None = None, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """RandomCrop(size=(H, W), padding=padding, fill=0) on every image of the batch, with its own offset."""
    _check_batch(images, "random_crop")
    if offsets is None:
        offsets = draw_crop_offsets(len(images), padding, images.device, generator)
    return crop(images, padding, offsets)


def draw_flips(
    n: int, p: float = 0.5, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> torch.Tensor:
    """(n,) bool mask, True with probability p: RandomHorizontalFlip's ``torch.rand(1) < p``, n at a time."""
    return torch.rand(n, device=device, generator=generator) < p


def flip(images: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mirror the width axis of the images where ``mask`` is True; the others are copied unchanged."""
    _check_batch(images, "flip")
    if mask.shape != (len(images),):
        raise ValueError(f"mask must have shape ({len(images)},), got {tuple(mask.shape)}")
    return torch.where(mask.to(images.device).view(-1, 1, 1, 1), images.flip(3), images)


def random_flip(
    images: torch.Tensor, generator: torch.Generator | None = None, mask: torch.Tensor | None = None, p: float = 0.5
) -> torch.Tensor:
    """RandomHorizontalFlip(p) on every image of the batch, each with its own draw."""
    _check_batch(images, "random_flip")
    if mask is None:
        mask = draw_flips(len(images), p, images.device, generator)
    return flip(images, mask)


def normalize(
    images_uint8: torch.Tensor,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
    channels_last: bool = False,
) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 ``(x / 255 - mean) / std`` per channel: ToTensor + Normalize, bitwise;
    ``channels_last`` converts the uint8 input, a quarter of the bytes."""
    _check_batch(images_uint8, "normalize")
    if images_uint8.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 images (0..255), got {images_uint8.dtype}")
    if len(mean) != images_uint8.shape[1] or len(std) != images_uint8.shape[1]:
        raise ValueError(
            f"mean and std need one value per channel ({images_uint8.shape[1]}), got {len(mean)} and {len(std)}"
        )
    if channels_last:
        images_uint8 = images_uint8.contiguous(memory_format=torch.channels_last)
    # ToTensor's and Normalize's exact operations in float32, keeping the memory format.
    mean_t, std_t = _channel_tensor(mean, images_uint8.device), _channel_tensor(std, images_uint8.device)
    return images_uint8.to(torch.float32).div_(255).sub_(mean_t).div_(std_t)


def _channel_tensor(values: Sequence[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """(C, 1, 1) float32 on ``device``; tensors already there are used as they are (no copy per batch)."""
    if isinstance(values, torch.Tensor) and values.device == device and values.dtype == torch.float32:
        return values.view(-1, 1, 1)
    return torch.as_tensor(values, dtype=torch.float32, device=device).view(-1, 1, 1)


def batch_transform(
    mean: Sequence[float],
    std: Sequence[float],
    padding: int = 0,
    flip_p: float = 0.0,
    generator: torch.Generator | None = None,
    channels_last: bool = False,
) -> BatchTransform:
    """A uint8 batch -> normalised float32 batch function: crop (if padding), flip (if flip_p), normalise;
    ``batch_transform(mean, std)`` is the evaluation transform."""
    if padding < 0 or not 0.0 <= flip_p <= 1.0:
        raise ValueError(f"padding={padding} must be >= 0 and flip_p={flip_p} within [0, 1]")
    # mean/std once per device: a pageable host -> GPU copy per batch would make the host wait for the GPU.
    constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def transform(images: torch.Tensor) -> torch.Tensor:
        if padding:
            images = random_crop(images, padding, generator)
        if flip_p:
            images = random_flip(images, generator, p=flip_p)
        if images.device not in constants:
            constants[images.device] = (_channel_tensor(mean, images.device), _channel_tensor(std, images.device))
        return normalize(images, *constants[images.device], channels_last)

    return transform
