"""Pictures for TensorBoard's image tab as (3, H, W) uint8 tensors, drawn with Pillow (no matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

MAX_SIDE = 1600  # pixels of the matrix at most: beyond it cells shrink and show no numbers
MAX_NAME = 24  # characters of a class name shown; a longer one is cut, so it cannot widen the figure
PAD = 6
BACKGROUND, INK, FAINT, RULE = (255, 255, 255), (0, 0, 0), (90, 90, 90), (215, 215, 215)
RIGHT, WRONG = (0, 120, 0), (200, 0, 0)
LOW, HIGH = np.array((255, 255, 255)), np.array((8, 48, 107))  # share 0 is white, share 1 dark blue

Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


@lru_cache(maxsize=None)
def font(size: int) -> Font:
    """Pillow's own font at ``size`` pixels (without FreeType, its fixed-size bitmap font)."""
    try:
        return ImageFont.load_default(size=size)
    except (ImportError, OSError, TypeError):
        return ImageFont.load_default()


def confusion_figure(confusion: torch.Tensor, class_names: Sequence[str]) -> torch.Tensor:
    """Rows are true classes, columns predicted ones. A cell's colour is its share of the row (on the
    diagonal, the class's accuracy), so classes of different sizes compare; its number is the count."""
    counts = _check_confusion(confusion, class_names)
    k = len(class_names)
    label_font, number_font, head_font = font(11), font(10), font(12)
    numbers = [[str(v) for v in row] for row in counts.tolist()]
    widest_number = max(_width(n, number_font) for row in numbers for n in row)
    cell = max(28, widest_number + 8)
    if k * cell > MAX_SIDE:
        cell = max(2, MAX_SIDE // k)
    show_numbers, show_names = widest_number + 4 <= cell, cell >= 8  # else they would overlap
    names = [_shown(n, label_font) for n in class_names] if show_names else [""] * k
    name_width = max(_width(n, label_font) for n in names) + 4
    line = _height("Ag%", label_font) + 4

    total, right = int(counts.sum()), int(counts.diag().sum())
    headline = f"{total} images, accuracy {right / max(1, total):.1%}; colour: share of the true class"
    left, top, side = PAD + line + name_width, PAD + 2 * line + name_width, k * cell
    bar_left = left + side + 12
    width = max(bar_left + 14 + 4 + _width("100%", label_font) + PAD, PAD + _width(headline, head_font) + PAD)
    canvas = Image.new("RGB", (width, top + side + PAD + line // 2), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    draw.text((PAD, PAD), headline, font=head_font, fill=INK)
    _centered(draw, (left + side / 2, PAD + line * 1.5), "predicted", label_font, FAINT)
    canvas.paste(*_rotated("true", label_font, FAINT, centre=(PAD + line / 2, top + side / 2)))

    shares = counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1)
    heat = Image.fromarray(_colour(shares.numpy()), "RGB").resize((side, side), Image.Resampling.NEAREST)
    canvas.paste(heat, (left, top))
    dark = (shares > 0.5).tolist()
    for i in range(k):
        edge = i * cell
        if cell >= 8 and i:  # white cells next to white cells need a rule between them
            draw.line([(left + edge, top), (left + edge, top + side - 1)], fill=RULE)
            draw.line([(left, top + edge), (left + side - 1, top + edge)], fill=RULE)
        centre = edge + cell / 2
        if show_names:
            at = (left - 3 - _width(names[i], label_font), top + centre - _height(names[i], label_font) / 2 - 1)
            draw.text(at, names[i], font=label_font, fill=INK)
            canvas.paste(*_rotated(names[i], label_font, INK, bottom_centre=(left + centre, top - 3)))
        for j in range(k) if show_numbers else ():
            ink = BACKGROUND if dark[i][j] else INK  # readable on dark blue and on white
            _centered(draw, (left + j * cell + cell / 2, top + centre), numbers[i][j], number_font, ink)
    draw.rectangle([left - 1, top - 1, left + side, top + side], outline=FAINT)

    # The colour scale: 100% at the top, 0% at the bottom.
    ramp = np.linspace(1, 0, max(2, side))[:, None].repeat(14, axis=1)
    canvas.paste(Image.fromarray(_colour(ramp), "RGB"), (bar_left, top))
    draw.rectangle([bar_left - 1, top - 1, bar_left + 14, top + side], outline=FAINT)
    for share, y in ((1.0, top), (0.5, top + side / 2), (0.0, top + side)):
        label = f"{share:.0%}"
        draw.text((bar_left + 18, y - _height(label, label_font) / 2 - 1), label, font=label_font, fill=INK)
    return _to_tensor(canvas)


def prediction_grid(
    pictures: torch.Tensor,
    predicted: torch.Tensor,
    true: torch.Tensor,
    class_names: Sequence[str],
    columns: int = 8,
    scale: int = 2,
) -> torch.Tensor:
    """Each picture (N, 3 or 1, H, W; float in [0, 1] or uint8) enlarged ``scale`` times over its predicted class
    (green when right; red, framed, when wrong) and its true one."""
    pixels = _check_pictures(pictures, predicted, true, class_names, columns, scale)
    n, _, height, width = pixels.shape
    predicted, true = predicted.tolist(), true.tolist()
    caption_font, head_font = font(10), font(12)
    image_w, image_h = width * scale, height * scale
    line = _height("Ag", caption_font) + 3
    names_width = max(_width(_shown(name, caption_font), caption_font) for name in class_names)
    widest = names_width + _width("true: ", caption_font)
    tile_w = max(image_w, min(widest, 4 * image_w)) + 4  # the frame's 2 pixels each side
    tile_h = image_h + 4 + 2 * line
    rows, columns = -(-n // columns), min(columns, n)
    right = sum(p == t for p, t in zip(predicted, true))
    headline = f"predicted (red: wrong) over true; {right} of {n} right"
    head_h = _height(headline, head_font) + 6
    canvas_w = max(PAD + columns * (tile_w + PAD), 2 * PAD + _width(headline, head_font))
    canvas = Image.new("RGB", (canvas_w, PAD + head_h + rows * (tile_h + PAD)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    draw.text((PAD, PAD), headline, font=head_font, fill=INK)
    for i in range(n):
        x, y = PAD + (i % columns) * (tile_w + PAD), PAD + head_h + (i // columns) * (tile_h + PAD)
        image_x = x + (tile_w - image_w) // 2
        wrong = predicted[i] != true[i]
        if wrong:
            draw.rectangle([image_x - 2, y, image_x + image_w + 1, y + image_h + 3], fill=WRONG)
        picture = Image.fromarray(pixels[i].permute(1, 2, 0).squeeze(2).contiguous().numpy())
        canvas.paste(picture.convert("RGB").resize((image_w, image_h), Image.Resampling.NEAREST), (image_x, y + 2))
        shown_predicted = _fit(_shown(class_names[predicted[i]], caption_font), caption_font, tile_w)
        shown_true = _fit("true: " + _shown(class_names[true[i]], caption_font), caption_font, tile_w)
        for row, (text, ink) in enumerate(((shown_predicted, WRONG if wrong else RIGHT), (shown_true, FAINT))):
            _centered(draw, (x + tile_w / 2, y + image_h + 4 + row * line + line / 2), text, caption_font, ink)
    return _to_tensor(canvas)


def _check_confusion(confusion: torch.Tensor, class_names: Sequence[str]) -> torch.Tensor:
    if not isinstance(confusion, torch.Tensor):
        raise ValueError(f"confusion matrix: expected a torch.Tensor, got {type(confusion).__name__}")
    if confusion.ndim != 2 or confusion.shape[0] != confusion.shape[1]:
        raise ValueError(f"confusion matrix must be square (classes x classes), got shape {tuple(confusion.shape)}")
    if confusion.shape[0] == 0:
        raise ValueError("confusion matrix is empty: it needs at least one class")
    if len(class_names) != (k := confusion.shape[0]):
        raise ValueError(f"{k} x {k} confusion matrix but {len(class_names)} class names")
    counts = confusion.detach().cpu().double()
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("confusion matrix holds a negative or non-finite count")
    return counts.round().long()


def _check_pictures(
    pictures: torch.Tensor,
    predicted: torch.Tensor,
    true: torch.Tensor,
    class_names: Sequence[str],
    columns: int,
    scale: int,
) -> torch.Tensor:
    """The pictures as uint8 on the CPU, once the labels are known to name classes."""
    if not isinstance(pictures, torch.Tensor) or pictures.ndim != 4 or pictures.shape[1] not in (1, 3):
        shape = tuple(pictures.shape) if isinstance(pictures, torch.Tensor) else type(pictures).__name__
        raise ValueError(f"pictures must be a (N, 3 or 1, H, W) tensor, got {shape}")
    n = pictures.shape[0]
    if n == 0 or pictures.shape[2] == 0 or pictures.shape[3] == 0:
        raise ValueError(f"pictures: nothing to draw in shape {tuple(pictures.shape)}")
    if columns < 1 or scale < 1:
        raise ValueError(f"columns={columns} and scale={scale} must both be at least 1")
    for name, labels in (("predicted", predicted), ("true", true)):
        if not isinstance(labels, torch.Tensor) or labels.shape != (n,):
            shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ValueError(f"{name} labels: expected one per picture, shape ({n},), got {shape}")
        if labels.min() < 0 or labels.max() >= len(class_names):
            low, high = int(labels.min()), int(labels.max())
            raise ValueError(f"{name} labels range {low}..{high}, but there are {len(class_names)} class names")
    pixels = pictures.detach().cpu()
    if pixels.dtype != torch.uint8:
        pixels = (pixels.float().nan_to_num(0).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.contiguous()


def _colour(shares: np.ndarray) -> np.ndarray:
    """Shares in [0, 1] of any shape -> uint8 RGB of that shape plus 3, from white to dark blue."""
    return (LOW + (HIGH - LOW) * shares[..., None]).round().clip(0, 255).astype(np.uint8)


def _shown(name: str, text_font: Font) -> str:
    name = str(name)
    if len(name) > MAX_NAME:
        name = name[: MAX_NAME - 3] + "..."
    if not isinstance(text_font, ImageFont.FreeTypeFont):  # the bitmap font encodes latin-1 only
        name = name.encode("latin-1", "replace").decode("latin-1")
    return name


def _fit(text: str, text_font: Font, width: int) -> str:
    """``text`` cut short (ending in "..") to fit ``width`` pixels."""
    if _width(text, text_font) <= width:
        return text
    while len(text) > 1 and _width(text + "..", text_font) > width:
        text = text[:-1]
    return text + ".."


def _width(text: str, text_font: Font) -> int:
    return int(np.ceil(text_font.getlength(text))) if text else 0


def _height(text: str, text_font: Font) -> int:
    left, top, right, bottom = text_font.getbbox(text)
    return bottom - top


def _centered(
    draw: ImageDraw.ImageDraw, centre: tuple[float, float], text: str, text_font: Font, ink: tuple[int, int, int]
) -> None:
    # By the text's box, not anchor="mm": the bitmap font has no anchors.
    left, top, right, bottom = draw.textbbox((0, 0), text, font=text_font)
    at = round(centre[0] - (left + right) / 2), round(centre[1] - (top + bottom) / 2)
    draw.text(at, text, font=text_font, fill=ink)


def _rotated(
    text: str,
    text_font: Font,
    ink: tuple[int, int, int],
    centre: tuple[float, float] | None = None,
    bottom_centre: tuple[float, float] | None = None,
) -> tuple[Image.Image, tuple[int, int], Image.Image]:
    """``text`` turned to read upwards, with where to paste it and its mask: ``canvas.paste(*_rotated(...))``."""
    left, top, right, bottom = text_font.getbbox(text or " ")
    label = Image.new("RGBA", (max(1, right), max(1, bottom)), (0, 0, 0, 0))
    ImageDraw.Draw(label).text((0, 0), text, font=text_font, fill=(*ink, 255))
    label = label.crop((0, top, label.width, label.height)).rotate(90, expand=True)
    if centre is not None:
        x, y = centre[0] - label.width / 2, centre[1] - label.height / 2
    else:
        x, y = bottom_centre[0] - label.width / 2, bottom_centre[1] - label.height
    return label, (round(x), round(y)), label


def _to_tensor(canvas: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1).contiguous()
