"""ddp_core.training.augment: the batched ops equal torchvision's per-image transforms, given the same
random decisions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import functional as TF

from ddp_core.training.augment import (
    batch_transform,
    crop,
    draw_crop_offsets,
    draw_flips,
    flip,
    normalize,
    random_crop,
    random_flip,
)
from ddp_core.training.seed import get_rng_state, set_rng_state

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PADDING = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def images_hwc() -> np.ndarray:
    """24 random uint8 (32, 32, 3) images: random content shows any misplaced pixel."""
    return np.random.default_rng(0).integers(0, 256, (24, 32, 32, 3), dtype=np.uint8)


def nchw(images_hwc: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images_hwc).permute(0, 3, 1, 2).contiguous()


def pil_to_nchw(pil_images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in pil_images])


def every_offset(n: int) -> torch.Tensor:
    """(n, 2) offsets walking through all 9 x 9 (top, left) pairs, corners included."""
    pairs = torch.cartesian_prod(torch.arange(2 * PADDING + 1), torch.arange(2 * PADDING + 1))
    return pairs[torch.arange(n) * 7 % len(pairs)]


def test_crop_equals_torchvision_crop_of_the_zero_padded_image(images_hwc):
    offsets = every_offset(len(images_hwc))
    offsets[0], offsets[1], offsets[2] = torch.tensor([0, 0]), torch.tensor([8, 8]), torch.tensor([0, 8])
    expected = [
        TF.crop(TF.pad(Image.fromarray(image), PADDING, fill=0), int(top), int(left), 32, 32)
        for image, (top, left) in zip(images_hwc, offsets)
    ]
    assert torch.equal(crop(nchw(images_hwc), PADDING, offsets), pil_to_nchw(expected))


def test_centre_offset_is_the_identity_and_corners_show_the_zero_padding(images_hwc):
    batch = nchw(images_hwc)
    assert torch.equal(crop(batch, PADDING, torch.full((len(batch), 2), PADDING)), batch)
    corner = crop(batch, PADDING, torch.zeros(len(batch), 2, dtype=torch.int64))
    assert corner[:, :, :PADDING, :].eq(0).all() and corner[:, :, :, :PADDING].eq(0).all()
    assert torch.equal(corner[:, :, PADDING:, PADDING:], batch[:, :, :-PADDING, :-PADDING])


def test_padding_zero_returns_a_copy(images_hwc):
    batch = nchw(images_hwc)
    out = random_crop(batch, 0)
    assert torch.equal(out, batch) and out.data_ptr() != batch.data_ptr()


def test_flip_equals_torchvision_hflip_where_the_mask_says(images_hwc):
    mask = torch.arange(len(images_hwc)) % 3 == 0
    expected = [
        TF.hflip(Image.fromarray(image)) if flipped else Image.fromarray(image)
        for image, flipped in zip(images_hwc, mask)
    ]
    assert torch.equal(flip(nchw(images_hwc), mask), pil_to_nchw(expected))


def test_normalize_is_bitwise_to_tensor_plus_normalize(images_hwc):
    reference = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    expected = torch.stack([reference(Image.fromarray(image)) for image in images_hwc])
    out = normalize(nchw(images_hwc), MEAN, STD)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    torch.testing.assert_close(
        out, (nchw(images_hwc).float() / 255 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    )


def test_channels_last_has_the_same_values_in_the_other_memory_format(images_hwc):
    out = normalize(nchw(images_hwc), MEAN, STD, channels_last=True)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert torch.equal(out, normalize(nchw(images_hwc), MEAN, STD))


def test_the_whole_training_transform_matches_torchvisions_compose_image_by_image(images_hwc):
    """Replay torchvision's own draws (RandomCrop: top then left; RandomHorizontalFlip: rand(1) < 0.5)."""
    reference = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=PADDING),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    expected, offsets, flips = [], [], []
    for k, image in enumerate(images_hwc):
        torch.manual_seed(k)
        expected.append(reference(Image.fromarray(image)))
        torch.manual_seed(k)
        top, left = torch.randint(0, 2 * PADDING + 1, (1,)).item(), torch.randint(0, 2 * PADDING + 1, (1,)).item()
        offsets.append((top, left))
        flips.append(bool(torch.rand(1) < 0.5))
    assert 0 < sum(flips) < len(flips) and len(set(offsets)) > 5  # the decisions vary, or this proves little
    batch = random_crop(nchw(images_hwc), PADDING, offsets=torch.tensor(offsets))
    batch = random_flip(batch, mask=torch.tensor(flips))
    assert torch.equal(normalize(batch, MEAN, STD), torch.stack(expected))


def test_draws_cover_torchvisions_ranges():
    generator = torch.Generator().manual_seed(0)
    offsets = draw_crop_offsets(20_000, PADDING, generator=generator)
    counts = torch.bincount(offsets.flatten(), minlength=9)
    assert len(counts) == 9 and counts.min() > 0.85 * 40_000 / 9 and counts.max() < 1.15 * 40_000 / 9
    flips = draw_flips(20_000, generator=generator)
    assert flips.dtype == torch.bool and 0.45 < flips.float().mean() < 0.55
    assert (
        0.17 < draw_flips(20_000, p=0.2, generator=generator).float().mean() < 0.23
    )  # True means flip, with probability p


def test_each_image_gets_its_own_decision(images_hwc):
    batch = nchw(images_hwc[:1]).expand(64, -1, -1, -1).contiguous()  # one image, 64 times
    out = random_flip(random_crop(batch, PADDING, torch.Generator().manual_seed(1)), torch.Generator().manual_seed(2))
    assert len(torch.unique(out.flatten(1), dim=0)) > 20


def test_explicit_generator_reproduces_and_leaves_the_global_rng_alone(images_hwc):
    transform = batch_transform(MEAN, STD, padding=PADDING, flip_p=0.5, generator=torch.Generator().manual_seed(3))
    before = torch.get_rng_state()
    first = transform(nchw(images_hwc))
    assert torch.equal(torch.get_rng_state(), before)
    again = batch_transform(MEAN, STD, padding=PADDING, flip_p=0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again(nchw(images_hwc)), first)
    assert not torch.equal(transform(nchw(images_hwc)), first)  # the generator moved on


def test_global_rng_draws_resume_from_a_saved_rng_state(images_hwc):
    """What a checkpoint does: save ddp_core's RNG state between batches, restore it, get the same batches."""
    transform = batch_transform(MEAN, STD, padding=PADDING, flip_p=0.5)
    torch.manual_seed(11)
    transform(nchw(images_hwc))
    state = get_rng_state()
    expected = [transform(nchw(images_hwc)) for _ in range(3)]
    torch.manual_seed(99)  # anything else happening in between
    set_rng_state(state)
    assert all(torch.equal(transform(nchw(images_hwc)), batch) for batch in expected)
    assert not torch.equal(expected[0], expected[1])


def test_bad_inputs_are_rejected(images_hwc):
    with pytest.raises(TypeError, match="uint8"):
        normalize(nchw(images_hwc).float(), MEAN, STD)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        random_crop(nchw(images_hwc)[0], PADDING)
    with pytest.raises(ValueError, match="offsets"):
        crop(nchw(images_hwc), PADDING, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="mask"):
        flip(nchw(images_hwc), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="one value per channel"):
        normalize(nchw(images_hwc), MEAN[:2], STD)
