"""CIFAR10 on disk and in memory: the reader, the download, both input pipelines, and a test fixture writer.

``python -m experiments.cifar10_data --write-standin DIR`` writes generated images in the official format,
for a run without internet (``python -m experiments.cifar10 --data-dir DIR --no-verify``).

On disk: torchvision's format, ``<data_dir>/cifar-10-batches-py/`` holding ``data_batch_1..5`` (training,
10,000 images each), ``test_batch`` and ``batches.meta``. Each batch is a pickled dict: ``data`` a uint8
(N, 3072) array (each row a 3x32x32 image, channel-major: R plane, G plane, B plane, each row-major),
``labels`` a list of ints 0..9, plus ``batch_label`` and ``filenames``; ``batches.meta`` holds
``label_names``. The official files' md5 sums are checked by default (``verify=False`` accepts any
dataset in this format, such as the synthetic one the tests write with ``write_cifar10_format``).

In memory: ``load_split`` returns a ``Split``: uint8 (N, 32, 32, 3) images (HWC, as torchvision keeps
them) and int64 labels. Two pipelines turn them into training batches (both sharded by the same ``TrainSampler``, so the
same seed, epoch and rank give the same samples; see ``ddp_core.training.tensor_loader``):

* ``tensor`` (default): the dataset resident on the device as one tensor; crop, flip and normalise are
  batched tensor operations (``ddp_core.training.augment``) drawing from torch's global RNG, which the checkpoint's
  RNG state restores for a bitwise resume.
* ``torchvision``: Dataset + DataLoader + PIL transforms, the textbook reference (12x to 26x slower on CPU:
  docs/benchmarks.md).

torchvision is imported only inside the functions that need it: importing it costs about 1.8x
``import torch`` (docs/design.md, "Import cost of torchvision").
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple, Sequence

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

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
NUM_CLASSES = len(CLASSES)
IMAGE_SHAPE = (32, 32, 3)  # (H, W, C) as stored in memory
# Per-channel mean and standard deviation of the 50,000 training images' pixels, scaled to 0..1
# (the true std; the often-copied (0.2023, 0.1994, 0.2010) is a mean of per-image stds).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
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

Pipeline = Literal["tensor", "torchvision"]
PIPELINES: tuple[str, ...] = ("tensor", "torchvision")


class Split(NamedTuple):
    """One split in memory: uint8 (N, 32, 32, 3) images (HWC, as torchvision keeps them), int64 (N,) labels."""

    images: torch.Tensor
    labels: torch.Tensor


# ---------------------------------------------------------------------------------------------------
# Reading


def how_to_get_it(folder: Path) -> str:
    return (
        f"get it with --download (one process per filesystem downloads it), by copying the {BASE_FOLDER} folder "
        f"to {folder}, "
        f"or by mounting the Docker data volume at data/"
    )


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts of numpy arrays, lists and strings only: a corrupt or hostile file cannot run code.

    The official files (Python 2 pickles) and ``write_cifar10_format``'s (protocol 2 from Python 3, where
    bytes are pickled as ``_codecs.encode``) need nothing beyond these globals.
    """

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


def _unpickle(path: Path) -> Any:
    """Load one batch file; any failure becomes a one-line ConfigError naming the file."""
    data = path.read_bytes()  # from memory, a bogus length in the pickle cannot make a read allocate gigabytes
    try:
        return _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as error:  # a damaged pickle can raise almost anything (EOFError, KeyError, MemoryError, ...)
        reason = " ".join(str(error).split())[:120]  # one line, and short
        raise ConfigError(
            f"{path} is truncated or corrupt ({type(error).__name__}: {reason}): delete it and download "
            f"CIFAR10 again (--download), or copy the {BASE_FOLDER} folder again"
        ) from None


def _check_batch(path: Path, entry: Any) -> tuple[np.ndarray, np.ndarray]:
    """The (N, 3072) uint8 data and (N,) labels of a batch dict, or a ConfigError saying what is wrong."""
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        raise ConfigError(f"{path} is not a CIFAR10 batch (expected a dict with 'data' and 'labels'): re-download it")
    data = entry["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise ConfigError(f"{path}: 'data' is {dtype} with shape {shape}, expected uint8 (N, 3072): re-download it")
    labels = np.asarray(entry["labels"])
    if labels.size and labels.dtype.kind not in "iu":  # floats would be truncated silently, text fail later
        raise ConfigError(f"{path}: 'labels' is not a list of integers ({labels.dtype}): re-download it")
    labels = labels.astype(np.int64)
    if labels.shape != (len(data),):
        raise ConfigError(f"{path}: {len(data)} images but 'labels' has shape {labels.shape}: re-download it")
    if len(labels) and not (0 <= labels.min() and labels.max() < NUM_CLASSES):
        raise ConfigError(
            f"{path}: labels range {labels.min()}..{labels.max()}, expected 0..{NUM_CLASSES - 1}: re-download it"
        )
    return data, labels


def _check_meta(path: Path, entry: Any) -> None:
    names = entry.get("label_names") if isinstance(entry, dict) else None
    if not isinstance(names, list) or len(names) != NUM_CLASSES:
        raise ConfigError(f"{path}: expected 'label_names' with {NUM_CLASSES} names: re-download it")


def _verify(folder: Path, names: Sequence[str]) -> None:
    for name in names:
        if _md5(folder / name) != MD5[name]:
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
    _check_meta(folder / META_FILE, _unpickle(folder / META_FILE))
    parts = [_check_batch(folder / name, _unpickle(folder / name)) for name in names[:-1]]
    data = np.concatenate([data for data, _ in parts])
    labels = np.concatenate([labels for _, labels in parts])
    # Rows are channel-major (3, 32, 32); torchvision keeps images as (32, 32, 3), and so do we.
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return Split(torch.from_numpy(images), torch.from_numpy(labels))


def download(data_dir: str | Path = DEFAULT_DATA_DIR) -> None:
    """Download and extract the official archive into data_dir, unless the files are there and intact.

    One process at a time: call ``download_once`` (every rank downloading at once is a classic mistake).
    torchvision checks the archive's md5 and then loads the small test split.
    """
    from torchvision.datasets import CIFAR10

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    CIFAR10(root=str(data_dir), train=False, download=True)


DOWNLOAD_LOCK = ".cifar10-download.lock"
DOWNLOAD_FAILED = ".cifar10-download.failed"


def download_once(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    verify: bool = True,
    fetch: Callable[[str | Path], None] | None = None,
    job: str | None = None,
) -> None:
    """Every process calls it before the process group exists; the data is downloaded once per filesystem.

    An exclusive ``flock`` on ``data_dir/.cifar10-download.lock`` lets one process at a time in: the first
    finds the data missing and downloads it (``fetch``, default ``download``), the next ones find it there
    (md5-checked when ``verify``) and go on. Several processes on one node, and nodes sharing the folder
    over NFS, never download at once. Waiting on a lock is not a collective: no DIST_TIMEOUT_S applies.

    A failed download raises a one-line ConfigError, and leaves it in ``.cifar10-download.failed`` for the
    processes of the same ``job`` (default: from the launcher's variables) waiting behind the lock: they
    raise the same line instead of trying again, one after another. A failure left by an earlier job (or
    written before this process started) is ignored: this process tries the download itself.
    """
    folder = Path(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    job = _job_id() if job is None else job
    with open(folder / DOWNLOAD_LOCK, "a") as lock:  # "a": created if missing, never truncated
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, and by the kernel if this process dies
        earlier = _failure_of_this_job(folder, job)
        if earlier:
            raise ConfigError(earlier)
        if _complete(folder, verify):
            return
        try:
            (fetch or download)(data_dir)
        except Exception as error:  # the network, the disk, a bad archive: one line on every process
            reason = " ".join(str(error).split())[:200] or type(error).__name__
            message = (
                f"--download failed ({type(error).__name__}: {reason}): check this machine's network access, "
                f"or copy the {BASE_FOLDER} folder to {folder.resolve()} and drop --download"
            )
            if job:
                (folder / DOWNLOAD_FAILED).write_text(json.dumps({"job": job, "time": time.time(), "message": message}))
            raise ConfigError(message) from None
        (folder / DOWNLOAD_FAILED).unlink(missing_ok=True)


def _complete(folder: Path, verify: bool) -> bool:
    """Every file of the dataset present, and the official ones when ``verify`` (a download killed halfway
    leaves truncated files: they are downloaded again)."""
    names = TRAIN_FILES + TEST_FILES + (META_FILE,)
    files = dataset_folder(folder)
    if not all((files / name).is_file() for name in names):
        return False
    return not verify or all(_md5(files / name) == MD5[name] for name in names)


def _job_id() -> str:
    """What every process of one launch shares, and a relaunch or a restart does not ("" for a world of one)."""
    parts = [
        os.environ.get(name, "")
        for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    ]
    return "/".join(parts) if any(parts) else ""


def _failure_of_this_job(folder: Path, job: str) -> str | None:
    """The message of a failed download by another process of this job, if there is one."""
    try:
        failure = json.loads((folder / DOWNLOAD_FAILED).read_text())
    except (OSError, ValueError):
        return None
    # The time too: a static rendezvous relaunched on the same port has the same job id.
    if not job or failure.get("job") != job or failure.get("time", 0) < _process_started_at():
        return None
    return str(failure.get("message", "--download failed in another process of this job"))


def _process_started_at() -> float:
    """When this process started, wall clock (Linux's /proc, to the second); elsewhere, now."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + int(after_name[19]) / os.sysconf("SC_CLK_TCK") - 1.0  # btime is whole seconds: a second's margin
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


# ---------------------------------------------------------------------------------------------------
# Writing (test fixtures, synthetic data)


def _batch_dict(images_hwc: np.ndarray, labels: np.ndarray, batch_label: str, first_index: int) -> dict[str, Any]:
    return {
        "batch_label": batch_label,
        "labels": [int(label) for label in labels],
        "data": np.ascontiguousarray(images_hwc.transpose(0, 3, 1, 2)).reshape(len(images_hwc), 3072),
        "filenames": [f"synthetic_{first_index + i:06d}.png" for i in range(len(images_hwc))],
    }


def _as_uint8_hwc(
    images: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray | Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    images = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    labels = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if images.dtype != np.uint8 or images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(f"images must be uint8 (N, 32, 32, 3), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),):
        raise ValueError(f"{len(images)} images but labels of shape {labels.shape}")
    return images, labels


def _dump(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "wb") as file:
        pickle.dump(obj, file, protocol=2)  # the official files are protocol 2 pickles


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
    train_images, train_labels = _as_uint8_hwc(train_images, train_labels)
    test_images, test_labels = _as_uint8_hwc(test_images, test_labels)
    folder = dataset_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(train_images), len(TRAIN_FILES) + 1).astype(int)
    for i, name in enumerate(TRAIN_FILES):
        lo, hi = bounds[i], bounds[i + 1]
        _dump(folder / name, _batch_dict(train_images[lo:hi], train_labels[lo:hi], f"training batch {i + 1} of 5", lo))
    _dump(folder / TEST_FILES[0], _batch_dict(test_images, test_labels, "testing batch 1 of 1", 0))
    meta = {"label_names": list(label_names), "num_cases_per_batch": int(bounds[1] - bounds[0]), "num_vis": 3072}
    _dump(folder / META_FILE, meta)
    return folder


# Colours of the synthetic classes: far apart in RGB, so colour alone separates them despite the noise.
_PALETTE = np.array(
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


def make_learnable_images(n: int, seed: int = 0) -> Split:
    """n synthetic uint8 (n, 32, 32, 3) images with int64 labels that a small CNN learns in an epoch or two.

    Class c: colour ``_PALETTE[c]`` modulated by stripes that are horizontal for even c and vertical for
    odd c, with a period of 4, 6, 8, 12 or 16 pixels (by c // 2), at a random phase, with random
    brightness and pixel noise. Crop shifts and horizontal flips keep every cue (stripe orientation and
    period, colour), so augmentation does not hide the class. Labels are balanced and shuffled.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % NUM_CLASSES)
    period = np.array([4, 6, 8, 12, 16], dtype=np.float32)[labels // 2]
    phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)
    coordinate = np.arange(32, dtype=np.float32)
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * coordinate[None, :] / period[:, None] + phase[:, None])  # (n, 32)
    horizontal = (labels % 2 == 0)[:, None, None]
    stripes = np.where(horizontal, wave[:, :, None], wave[:, None, :])  # (n, 32, 32): rows or columns vary
    brightness = rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32)
    images = _PALETTE[labels][:, None, None, :] * brightness * (0.5 + 0.5 * stripes[..., None])
    images += rng.normal(0, 16, images.shape).astype(np.float32)
    return Split(
        torch.from_numpy(np.clip(images, 0, 255).round().astype(np.uint8)), torch.from_numpy(labels.astype(np.int64))
    )


# ---------------------------------------------------------------------------------------------------
# Input pipelines


def torchvision_train_transform() -> Any:
    """The textbook CIFAR10 training transform: RandomCrop(32, padding=4), flip, ToTensor, Normalize."""
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.RandomCrop(32, padding=CROP_PADDING),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


def torchvision_eval_transform() -> Any:
    from torchvision import transforms

    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


def _check_pipeline(pipeline: str) -> None:
    if pipeline not in PIPELINES:
        raise ConfigError(f"input pipeline {pipeline!r} is not one of {', '.join(PIPELINES)}")


def train_loader(
    split: Split,
    sampler: TrainSampler,
    batch_size: int,
    pipeline: Pipeline = "tensor",
    device: torch.device | str = "cpu",
    num_workers: int = 0,
    seed: int = 0,
    rank: int = 0,
    augment: bool = True,
    channels_last: bool = False,
) -> ResidentLoader | DeviceLoader:
    """Training batches of this rank's shard: (float32 (B, 3, 32, 32) normalised, int64 (B,)) on ``device``.

    Partial batches are dropped, so every rank runs the same number of steps. ``num_workers``, ``seed``
    and ``rank`` concern the torchvision pipeline's DataLoader (its generator and worker seeds); the
    tensor pipeline draws crops and flips from the global RNG of ``device``, which ``seed_rank_streams``
    makes per rank and the checkpoint's RNG state restores (see ``ddp_core.training.tensor_loader``).
    ``augment=False`` turns crop and flip off (normalisation only), in both pipelines.
    """
    _check_pipeline(pipeline)
    if pipeline == "tensor":
        transform = batch_transform(
            MEAN,
            STD,
            padding=CROP_PADDING if augment else 0,
            flip_p=0.5 if augment else 0.0,
            channels_last=channels_last,
        )
        return ResidentLoader(
            hwc_to_chw(split.images), split.labels, sampler, batch_size, transform, device, drop_last=True
        )
    transform = torchvision_train_transform() if augment else torchvision_eval_transform()
    dataset = ArrayImageDataset(split.images, split.labels, transform)
    return build_dataloader(
        dataset, sampler, batch_size, device, seed, rank, num_workers, drop_last=True, channels_last=channels_last
    )


def eval_batches(
    split: Split,
    rank: int,
    world_size: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    pipeline: Pipeline = "tensor",
    num_workers: int = 0,
    channels_last: bool = False,
) -> ResidentLoader | DeviceLoader:
    """Evaluation batches of this rank's ``EvalSampler`` shard (no padding, no augmentation, normalised).

    Ranks may get one sample more or less than each other: combine metrics with ``global_sum_count``.
    The tensor pipeline keeps the test set resident on ``device``: build this once and iterate it every
    evaluation.
    """
    _check_pipeline(pipeline)
    sampler = EvalSampler(len(split.labels), rank, world_size)
    if pipeline == "tensor":
        transform = batch_transform(MEAN, STD, channels_last=channels_last)
        return ResidentLoader(
            hwc_to_chw(split.images), split.labels, sampler, batch_size, transform, device, drop_last=False
        )
    dataset = ArrayImageDataset(split.images, split.labels, torchvision_eval_transform())
    return build_dataloader(
        dataset, sampler, batch_size, device, 0, rank, num_workers, drop_last=False, channels_last=channels_last
    )


def unnormalise(images: torch.Tensor) -> torch.Tensor:
    """Normalised (N, 3, H, W) images -> float pictures in [0, 1] on the CPU, as they looked before."""
    images = images.detach().float().cpu()
    return (images * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)).clamp(0, 1)


def image_grid(images: torch.Tensor, columns: int = 8, border: int = 2) -> torch.Tensor:
    """Normalised (N, 3, H, W) images -> one float (3, H', W') picture in [0, 1] for TensorBoard's add_image."""
    pictures = unnormalise(images)
    n, channels, height, width = pictures.shape
    rows = -(-n // columns)
    columns = min(columns, n)
    canvas = torch.ones(channels, rows * (height + border) + border, columns * (width + border) + border)
    for i, picture in enumerate(pictures):  # at most a few dozen images, once per run
        top, left = border + (i // columns) * (height + border), border + (i % columns) * (width + border)
        canvas[:, top : top + height, left : left + width] = picture
    return canvas


# ---------------------------------------------------------------------------------------------------
# A stand-in dataset for running without internet
# ---------------------------------------------------------------------------------------------------


def write_standin(data_dir: str | Path, train_images: int = 10_000, test_images: int = 1_000, seed: int = 0) -> Path:
    """Generated images (``make_learnable_images``) in the official on-disk format under ``data_dir``: the
    CIFAR10 experiment runs on them with ``--data-dir DATA_DIR --no-verify`` (their md5 sums are not the
    official ones). The small CNN reaches well above chance (10%) in two epochs. Returns the folder written."""
    train = make_learnable_images(train_images, seed=seed)
    test = make_learnable_images(test_images, seed=seed + 1)
    return write_cifar10_format(data_dir, train.images, train.labels, test.images, test.labels)


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
