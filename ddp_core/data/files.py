"""Dataset files: checksums, and pickles read without running their code."""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ddp_core.errors import ConfigError


def md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts of numpy arrays, lists and strings only (Python 2 pickles too): a file cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected global {module}.{name}")
        return super().find_class(module, name)


def unpickle(path: Path, fix: str) -> Any:
    """Load one pickled file; any failure is a one-line ConfigError naming the file, then ``fix``."""
    data = path.read_bytes()  # from memory, a bogus length in the pickle cannot make a read allocate gigabytes
    try:
        return ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as error:  # a damaged pickle can raise almost anything (EOFError, KeyError, MemoryError, ...)
        reason = " ".join(str(error).split())[:120]  # one line, and short
        raise ConfigError(f"{path} is truncated or corrupt ({type(error).__name__}: {reason}): {fix}") from None


def dump(path: Path, obj: Any) -> None:
    with open(path, "wb") as file:
        pickle.dump(obj, file, protocol=2)  # as Python 2 era datasets are: readable by ArrayUnpickler


# The pickled batch of CIFAR-10 and CIFAR-100 (and datasets written like them): a dict whose "data" is a uint8
# (N, C*H*W) array, each row an image channel-major, and whose "labels" are N integers.


def labelled_rows(path: Path, entry: Any, row_size: int, classes: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A batch dict's uint8 (N, row_size) data and int64 (N,) labels in 0..classes-1, or a ConfigError."""
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        raise ConfigError(f"{path} is not a {what} (expected a dict with 'data' and 'labels'): re-download it")
    data = entry["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != row_size:
        shape, dtype = getattr(data, "shape", None), getattr(data, "dtype", type(data).__name__)
        raise ConfigError(
            f"{path}: 'data' is {dtype} with shape {shape}, expected uint8 (N, {row_size}): re-download it"
        )
    labels = np.asarray(entry["labels"])
    if labels.size and labels.dtype.kind not in "iu":  # floats would be truncated silently, text fail later
        raise ConfigError(f"{path}: 'labels' is not a list of integers ({labels.dtype}): re-download it")
    labels = labels.astype(np.int64)
    if labels.shape != (len(data),):
        raise ConfigError(f"{path}: {len(data)} images but 'labels' has shape {labels.shape}: re-download it")
    if len(labels) and not (0 <= labels.min() and labels.max() < classes):
        raise ConfigError(
            f"{path}: labels range {labels.min()}..{labels.max()}, expected 0..{classes - 1}: re-download it"
        )
    return data, labels


def labelled_batch(images_hwc: np.ndarray, labels: np.ndarray, batch_label: str, first_index: int) -> dict[str, Any]:
    """The batch dict of uint8 (N, H, W, C) images: what ``labelled_rows`` reads back."""
    return {
        "batch_label": batch_label,
        "labels": [int(label) for label in labels],
        "data": np.ascontiguousarray(images_hwc.transpose(0, 3, 1, 2)).reshape(len(images_hwc), -1),
        "filenames": [f"synthetic_{first_index + i:06d}.png" for i in range(len(images_hwc))],
    }
