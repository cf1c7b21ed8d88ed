"""CIFAR10 on disk and in memory: the reader, the download, both input pipelines, and a stand-in writer.

``python -m experiments.cifar10_data --write-standin DIR`` writes generated images in the official format,
for a run without internet (``python -m experiments.cifar10 --data-dir DIR --no-verify``).

On disk: torchvision's format, ``<data_dir>/cifar-10-batches-py/`` holding ``data_batch_1..5`` (training,
10,000 images each), ``test_batch`` and ``batches.meta``. Each batch is a pickled dict: ``data`` a uint8
(N, 3072) array (each row a 3x32x32 image, channel-major: R plane, G plane, B plane, each row-major),
``labels`` a list of ints 0..9, plus ``batch_label`` and ``filenames``; ``batches.meta`` holds
``label_names``. The official files' md5 sums are checked by default (``verify=False`` accepts any
dataset in this format, such as the synthetic one the tests write with ``write_cifar10_format``).

In memory: ``load_split`` returns a ``Split``: uint8 (N, 32, 32, 3) images (HWC, as torchvision keeps
them) and int64 labels; ``train_loader`` and ``eval_batches`` batch them through either pipeline, ``tensor``
or ``torchvision`` (``ddp_core.data.images`` says how they differ). What is not CIFAR10's own (the download
once per filesystem, the safe unpickler, the pipelines, the generated images) is in ``ddp_core.data``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ddp_core.data import download as downloads
from ddp_core.data import images as pictures
from ddp_core.data.files import dump, labelled_batch, labelled_rows, md5, unpickle
from ddp_core.data.images import as_uint8_hwc
from ddp_core.errors import ConfigError
from ddp_core.training.tensor_loader import DeviceLoader, ResidentLoader

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
NUM_CLASSES = len(CLASSES)
IMAGE_SHAPE = (32, 32, 3)  # (H, W, C) as stored in memory
# Per-channel mean and std of the training set (RGB, images scaled to [0, 1]), the usual CIFAR10
# normalisation constants.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
NORM = (MEAN, STD)
CROP_PADDING = 4

BASE_FOLDER = "cifar-10-batches-py"
DEFAULT_DATA_DIR = "data"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
META_FILE = "batches.meta"
# md5 sums of the official archive's files, from torchvision/datasets/cifar.py (CIFAR10.train_list,
# test_list and meta); a unit test checks they still agree with the installed torchvision.
MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
DOWNLOAD_FAILED = downloads.failure_file("cifar10")
REFETCH = f"delete it and download CIFAR10 again (--download), or copy the {BASE_FOLDER} folder again"


class Split(NamedTuple):
    """One split in memory: uint8 (N, 32, 32, 3) images (HWC, as torchvision keeps them), int64 (N,) labels."""

    images: torch.Tensor
    labels: torch.Tensor


# ---------------------------------------------------------------------------------------------------
# Reading


def how_to_get_it(folder: Path) -> str:
    return (
        f"get it with --download (one process per filesystem downloads it), by copying the {BASE_FOLDER} folder "
        f"to {folder}, or by mounting the Docker data volume at data/"
    )


def _verify(folder: Path, names: Sequence[str]) -> None:
    for name in names:
        if md5(folder / name) != MD5[name]:
            raise ConfigError(
                f"{folder / name} does not match the official CIFAR10 file (md5 differs): it is truncated, corrupt "
                f"or another dataset; delete it and download again (--download), or pass --no-verify to use "
                f"a different dataset in the same format"
            )


def dataset_folder(data_dir: str | Path = DEFAULT_DATA_DIR) -> Path:
    return Path(data_dir) / BASE_FOLDER


def load_split(data_dir: str | Path = DEFAULT_DATA_DIR, train: bool = True, verify: bool = True) -> Split:
    """Read the training (``train=True``) or test split: ``Split(images uint8 (N, 32, 32, 3), labels int64 (N,))``.

    Raises ConfigError (exit code 2) when files are missing (the message says where it looked and how
    to get them), when ``verify`` and a file's md5 is not the official one, and when a file is truncated,
    corrupt or has the wrong shapes, dtypes or labels.
    """
    folder = dataset_folder(data_dir).resolve()
    names = (TRAIN_FILES if train else TEST_FILES) + (META_FILE,)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        what = f"{folder} lacks {', '.join(missing)}" if folder.is_dir() else f"no folder {folder}"
        raise ConfigError(f"CIFAR10 not found: {what}; {how_to_get_it(folder.parent)}")
    if verify:
        _verify(folder, names)
    meta = unpickle(folder / META_FILE, REFETCH)
    label_names = meta.get("label_names") if isinstance(meta, dict) else None
    if not isinstance(label_names, list) or len(label_names) != NUM_CLASSES:
        raise ConfigError(f"{folder / META_FILE}: expected 'label_names' with {NUM_CLASSES} names: re-download it")
    parts = [
        labelled_rows(folder / name, unpickle(folder / name, REFETCH), 3072, NUM_CLASSES, "CIFAR10 batch")
        for name in names[:-1]
    ]
    data = np.concatenate([data for data, _ in parts])
    labels = np.concatenate([labels for _, labels in parts])
    # Rows are channel-major (3, 32, 32); torchvision keeps images as (32, 32, 3), and so do we.
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return Split(torch.from_numpy(images), torch.from_numpy(labels))


def download(data_dir: str | Path = DEFAULT_DATA_DIR) -> None:
    """Download and extract the official archive into data_dir (torchvision checks its md5); one process at a
    time: call ``download_once``."""
    from torchvision.datasets import CIFAR10

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    CIFAR10(root=str(data_dir), train=False, download=True)


def download_once(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    verify: bool = True,
    fetch: Callable[[str | Path], None] | None = None,
    job: str | None = None,
) -> None:
    """Every process calls it before the process group exists: the data is downloaded (``fetch``, default
    ``download``) once per filesystem, unless every file is there (md5-checked when ``verify``: a download
    killed halfway leaves truncated files). ``ddp_core.data.download`` says how."""
    names = TRAIN_FILES + TEST_FILES + (META_FILE,)
    files = dataset_folder(data_dir)

    def complete() -> bool:
        present = all((files / name).is_file() for name in names)
        return present and (not verify or all(md5(files / name) == MD5[name] for name in names))

    instead = f"copy the {BASE_FOLDER} folder to {Path(data_dir).resolve()} and drop --download"
    get = fetch or download  # looked up now: tests replace this module's download
    downloads.download_once(Path(data_dir), "cifar10", complete, lambda: get(data_dir), instead, job)


# ---------------------------------------------------------------------------------------------------
# Writing: the official format, from any images (test fixtures, the stand-in)


def write_cifar10_format(
    root: str | Path,
    train_images: torch.Tensor | np.ndarray,
    train_labels: torch.Tensor | np.ndarray | Sequence[int],
    test_images: torch.Tensor | np.ndarray,
    test_labels: torch.Tensor | np.ndarray | Sequence[int],
    label_names: Sequence[str] = CLASSES,
) -> Path:
    """Write a dataset in the official on-disk format under ``root/cifar-10-batches-py``; returns that folder.

    Images are uint8 (N, 32, 32, 3). The training images are split into data_batch_1..5 in order (as
    evenly as possible), so ``load_split(root, verify=False)`` and torchvision's CIFAR10 (md5 check off)
    read them back in the same order.
    """
    train_images, train_labels = as_uint8_hwc(train_images, train_labels, IMAGE_SHAPE)
    test_images, test_labels = as_uint8_hwc(test_images, test_labels, IMAGE_SHAPE)
    folder = dataset_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(train_images), len(TRAIN_FILES) + 1).astype(int)
    for i, name in enumerate(TRAIN_FILES):
        lo, hi = bounds[i], bounds[i + 1]
        dump(
            folder / name, labelled_batch(train_images[lo:hi], train_labels[lo:hi], f"training batch {i + 1} of 5", lo)
        )
    dump(folder / TEST_FILES[0], labelled_batch(test_images, test_labels, "testing batch 1 of 1", 0))
    meta = {"label_names": list(label_names), "num_cases_per_batch": int(bounds[1] - bounds[0]), "num_vis": 3072}
    dump(folder / META_FILE, meta)
    return folder


def make_learnable_images(n: int, seed: int = 0) -> Split:
    """n generated images of the 10 classes that a small CNN learns in an epoch or two (``learnable_images``)."""
    return Split(*pictures.learnable_images(n, seed))


def write_standin(data_dir: str | Path, train_images: int = 10_000, test_images: int = 1_000, seed: int = 0) -> Path:
    """Generated images in the official on-disk format under ``data_dir``: the CIFAR10 experiment runs on them
    with ``--data-dir DATA_DIR --no-verify`` (their md5 sums are not the official ones). Returns the folder."""
    train = make_learnable_images(train_images, seed=seed)
    test = make_learnable_images(test_images, seed=seed + 1)
    return write_cifar10_format(data_dir, train.images, train.labels, test.images, test.labels)


# ---------------------------------------------------------------------------------------------------
# Input pipelines (ddp_core.data.images) with CIFAR10's normalisation and crop


def train_loader(split: Split, *args: Any, **options: Any) -> ResidentLoader | DeviceLoader:
    """``ddp_core.data.images.train_loader`` on ``split``, with CIFAR10's normalisation and crop."""
    return pictures.train_loader(*split, *args, norm=NORM, padding=CROP_PADDING, **options)


def eval_batches(split: Split, *args: Any, **options: Any) -> ResidentLoader | DeviceLoader:
    """``ddp_core.data.images.eval_batches`` on ``split``, with CIFAR10's normalisation."""
    return pictures.eval_batches(*split, *args, norm=NORM, **options)


def unnormalise(images: torch.Tensor) -> torch.Tensor:
    return pictures.unnormalise(images, NORM)


def image_grid(images: torch.Tensor, columns: int = 8, border: int = 2) -> torch.Tensor:
    return pictures.image_grid(images, NORM, columns, border)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m experiments.cifar10_data",
        description="Write a generated stand-in for CIFAR10 (no download), in its on-disk format; then train on it "
        "with: python -m experiments.cifar10 --data-dir DIR --no-verify",
    )
    parser.add_argument("--write-standin", metavar="DIR", required=True, help="folder to write cifar-10-batches-py/ in")
    parser.add_argument("--train-images", type=int, default=10_000, help="training images (default 10000)")
    parser.add_argument("--test-images", type=int, default=1_000, help="test images (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated images (default 0)")
    args = parser.parse_args(argv)
    if args.train_images < 1 or args.test_images < 1:
        parser.error("--train-images and --test-images must be at least 1")
    folder = write_standin(args.write_standin, args.train_images, args.test_images, args.seed)
    print(f"wrote {args.train_images} training and {args.test_images} test images to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
