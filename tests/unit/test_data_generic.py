"""ddp_core.data on a dataset that is not CIFAR10: other file names, image sizes, normalisation and classes.

CIFAR10's own module is tested through these functions in test_cifar10_data.py and test_download_once.py
(processes racing for the lock, failures shared within a job).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_core.data import download, files, images
from ddp_core.errors import ConfigError
from ddp_core.training.samplers import TrainSampler

NORM = ((0.5, 0.4, 0.3), (0.25, 0.2, 0.3))


def test_a_dataset_of_its_own_is_fetched_once_and_a_failure_ends_with_what_to_do_instead(tmp_path: Path):
    target, fetched = tmp_path / "words.txt", []

    def fetch() -> None:
        fetched.append(1)
        target.write_text("hello")

    for _ in range(2):
        download.download_once(tmp_path, "words", target.is_file, fetch, "copy words.txt by hand", job="job-1")
    assert fetched == [1] and (tmp_path / download.lock_file("words")).is_file()

    def fail() -> None:
        raise OSError("no route to host")

    target.unlink()
    with pytest.raises(ConfigError) as error:
        download.download_once(tmp_path, "words", target.is_file, fail, "copy words.txt by hand", job="job-1")
    assert str(error.value) == (
        "--download failed (OSError: no route to host): check this machine's network access, or copy words.txt by hand"
    )
    with pytest.raises(ConfigError, match="no route to host"):  # the same job's next process: the same line, no try
        download.download_once(tmp_path, "words", target.is_file, fetch, "copy words.txt by hand", job="job-1")
    assert fetched == [1]


def test_labelled_rows_read_back_what_labelled_batch_wrote_and_name_what_is_wrong(tmp_path: Path):
    rng = np.random.default_rng(0)
    pixels, labels = rng.integers(0, 256, (5, 8, 8, 1), dtype=np.uint8), np.array([0, 2, 1, 2, 0])
    files.dump(tmp_path / "batch", files.labelled_batch(pixels, labels, "batch 1", 0))
    rows, read = files.labelled_rows(tmp_path / "batch", files.unpickle(tmp_path / "batch", "fix"), 64, 3, "batch")
    assert np.array_equal(rows.reshape(5, 1, 8, 8).transpose(0, 2, 3, 1), pixels) and np.array_equal(read, labels)
    with pytest.raises(ConfigError, match=r"batch: labels range 0\.\.2, expected 0\.\.1: re-download it"):
        files.labelled_rows(tmp_path / "batch", files.unpickle(tmp_path / "batch", "fix"), 64, 2, "batch")
    (tmp_path / "hostile").write_bytes(pickle.dumps(print))
    with pytest.raises(
        ConfigError, match=r"hostile is truncated or corrupt \(UnpicklingError: .*builtins.print\): fix"
    ):
        files.unpickle(tmp_path / "hostile", "fix")


def test_both_pipelines_batch_small_images_alike_and_the_grid_undoes_the_normalisation():
    pictures, labels = images.learnable_images(12, seed=3, size=8)
    batches = {
        pipeline: next(
            iter(
                images.train_loader(
                    pictures, labels, TrainSampler(12, 0, 1, seed=0), 4, pipeline, augment=False, norm=NORM, padding=2
                )
            )
        )
        for pipeline in images.PIPELINES
    }
    assert batches["tensor"][0].shape == (4, 3, 8, 8)
    assert torch.equal(batches["tensor"][1], batches["torchvision"][1])
    torch.testing.assert_close(batches["tensor"][0], batches["torchvision"][0])
    grid = images.image_grid(batches["tensor"][0], NORM, columns=2, border=1)
    assert grid.shape == (3, 2 * 9 + 1, 2 * 9 + 1)
    torch.testing.assert_close(grid[:, 1:9, 1:9], images.unnormalise(batches["tensor"][0][:1], NORM)[0])
