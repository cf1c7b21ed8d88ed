"""CIFAR10 reader, fixture writer and both input pipelines, on a synthetic dataset in the exact on-disk format.

The pipeline tests use "index images": image i is filled with the bytes (i % 256, i // 256, 7 * (i % 10)), and
its label is i % 10. Any pixel of the centre survives a crop of up to 4 pixels and a flip, so the index of
every sample in a normalised batch can be read back, whichever pipeline made it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.training.samplers import TrainSampler
from ddp_core.training.seed import get_rng_state, loader_generator, set_rng_state, worker_init_fn
from experiments import cifar10_data
from experiments.cifar10_data import (
    CLASSES,
    MEAN,
    STD,
    Split,
    eval_batches,
    image_grid,
    load_split,
    make_learnable_images,
    train_loader,
    write_cifar10_format,
)

N_TRAIN, N_TEST, BATCH = 600, 100, 32
PIPELINES = ("tensor", "torchvision")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def index_images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = np.arange(n)
    colours = np.stack([index % 256, index // 256, 7 * (index % 10)], axis=1).astype(np.uint8)
    images = np.broadcast_to(colours[:, None, None, :], (n, 32, 32, 3)).copy()
    return torch.from_numpy(images), torch.from_numpy(index % 10)


def decode(images: torch.Tensor) -> list[int]:
    """The index of each image of a normalised batch, from its centre pixel."""
    pixel = images[:, :, 16, 16] * torch.tensor(STD) + torch.tensor(MEAN)
    values = (pixel * 255).round().long()
    return (values[:, 0] + 256 * values[:, 1]).tolist()


@pytest.fixture(scope="module")
def index_data() -> dict[str, torch.Tensor]:
    train_images, train_labels = index_images(N_TRAIN)
    test_images, test_labels = index_images(N_TEST)
    return {
        "train_images": train_images,
        "train_labels": train_labels,
        "test_images": test_images,
        "test_labels": test_labels,
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory, index_data) -> Path:
    """A data dir holding the index dataset in the official format; tests that damage it copy it first."""
    root = tmp_path_factory.mktemp("data")
    write_cifar10_format(root, **index_data)
    return root


@pytest.fixture
def data_dir(written, tmp_path) -> Path:
    """A private copy of the written dataset, free to damage."""
    shutil.copytree(written / "cifar-10-batches-py", tmp_path / "cifar-10-batches-py")
    return tmp_path


@pytest.fixture
def fixture_md5(monkeypatch, written) -> None:
    """Make the fixture's files the 'official' ones, to exercise verify=True on a dataset that passes."""
    folder = written / "cifar-10-batches-py"
    md5 = {name: hashlib.md5((folder / name).read_bytes()).hexdigest() for name in cifar10_data.MD5}
    monkeypatch.setattr(cifar10_data, "MD5", md5)


# ---------------------------------------------------------------------------------------------------
# Format and reader


def test_md5_sums_are_torchvisions():
    from torchvision.datasets import CIFAR10

    official = {name: md5 for name, md5 in CIFAR10.train_list + CIFAR10.test_list}
    official[CIFAR10.meta["filename"]] = CIFAR10.meta["md5"]
    assert cifar10_data.MD5 == official
    assert CIFAR10.base_folder == cifar10_data.BASE_FOLDER


def test_round_trip(written, index_data):
    for train, prefix in ((True, "train"), (False, "test")):
        split = load_split(written, train=train, verify=False)
        images, labels = split
        assert split.images is images and split.labels is labels
        assert images.dtype == torch.uint8 and images.shape == (len(index_data[f"{prefix}_images"]), 32, 32, 3)
        assert labels.dtype == torch.int64
        assert torch.equal(images, index_data[f"{prefix}_images"]) and torch.equal(
            labels, index_data[f"{prefix}_labels"]
        )


def test_round_trip_of_random_images_checks_the_channel_layout(tmp_path):
    rng = np.random.default_rng(5)
    train, test = (
        rng.integers(0, 256, (13, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
    )
    write_cifar10_format(tmp_path, train, np.arange(13) % 10, test, [9, 0, 1, 2])
    entry = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes(), encoding="latin1")
    assert np.array_equal(entry["data"][0, :1024].reshape(32, 32), train[0, :, :, 0])  # first the R plane, row-major
    images, labels = load_split(tmp_path, train=True, verify=False)
    assert np.array_equal(images.numpy(), train) and labels.tolist() == list(np.arange(13) % 10)
    assert load_split(tmp_path, train=False, verify=False)[1].tolist() == [9, 0, 1, 2]


def test_files_are_laid_out_like_the_official_ones(written):
    folder = written / "cifar-10-batches-py"
    assert sorted(os.listdir(folder)) == sorted(
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    )
    sizes = []
    for i in range(1, 6):
        raw = (folder / f"data_batch_{i}").read_bytes()
        assert raw[:2] == b"\x80\x02"  # pickle protocol 2
        entry = pickle.loads(raw, encoding="latin1")
        assert set(entry) == {"data", "labels", "batch_label", "filenames"}
        assert entry["data"].dtype == np.uint8 and entry["data"].shape == (len(entry["labels"]), 3072)
        assert all(type(label) is int for label in entry["labels"]) and len(entry["filenames"]) == len(entry["labels"])
        assert entry["batch_label"] == f"training batch {i} of 5"
        sizes.append(len(entry["labels"]))
    assert sizes == [N_TRAIN // 5] * 5
    meta = pickle.loads((folder / "batches.meta").read_bytes(), encoding="latin1")
    assert meta == {"label_names": list(CLASSES), "num_cases_per_batch": N_TRAIN // 5, "num_vis": 3072}


def test_torchvision_reads_the_fixture_with_its_md5_check_off(written, index_data, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)  # both the batches' and the meta's
    for train, prefix in ((True, "train"), (False, "test")):
        dataset = tv_cifar.CIFAR10(str(written), train=train)
        assert np.array_equal(dataset.data, index_data[f"{prefix}_images"].numpy())
        assert dataset.targets == index_data[f"{prefix}_labels"].tolist()
        assert dataset.classes == list(CLASSES)


def test_missing_data_says_where_it_looked_and_the_three_ways_to_get_it(tmp_path, capsys):
    with pytest.raises(ConfigError) as caught:
        load_split(tmp_path / "nowhere", train=True)
    message = str(caught.value)
    assert "\n" not in message
    assert f"no folder {(tmp_path / 'nowhere' / 'cifar-10-batches-py').resolve()}" in message
    assert (
        "--download" in message
        and "copying the cifar-10-batches-py folder" in message
        and "Docker" in message
        and "data/" in message
    )

    exit_code = pytest.raises(SystemExit, exits_with_one_line(load_split), tmp_path / "nowhere").value.code
    assert exit_code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_missing_file_is_named(data_dir):
    (data_dir / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(ConfigError, match="lacks data_batch_4;"):
        load_split(data_dir, train=True, verify=False)
    assert len(load_split(data_dir, train=False, verify=False)[0]) == N_TEST  # the test split does not need it


def test_verify_rejects_files_that_are_not_the_official_ones(written):
    with pytest.raises(ConfigError, match=r"data_batch_1 does not match the official CIFAR10 file.*--no-verify"):
        load_split(written, train=True, verify=True)
    with pytest.raises(ConfigError, match=r"test_batch does not match.*--no-verify"):
        load_split(written, train=False)  # verify is the default


def test_verify_accepts_files_with_the_expected_md5(written, fixture_md5, index_data):
    images, labels = load_split(written, train=True, verify=True)
    assert torch.equal(images, index_data["train_images"]) and torch.equal(labels, index_data["train_labels"])


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(3).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("damage", [cut_in_half, random_bytes])
@pytest.mark.parametrize("name", ["data_batch_3", "batches.meta"])
def test_a_damaged_file_is_named_without_a_pickle_traceback(data_dir, damage, name):
    damage(data_dir / "cifar-10-batches-py" / name)
    with pytest.raises(ConfigError) as caught:
        load_split(data_dir, train=True, verify=False)
    message = str(caught.value)
    assert f"{name} is truncated or corrupt" in message and "--download" in message and "\n" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no chained pickle traceback


def test_a_damaged_file_fails_the_md5_check_first(data_dir, fixture_md5):
    cut_in_half(data_dir / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(
        ConfigError, match=r"data_batch_3 does not match the official CIFAR10 file \(md5 differs\): it is truncated"
    ):
        load_split(data_dir, train=True)


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def test_a_pickle_that_would_run_code_is_refused(data_dir):
    marker = data_dir / "code-ran"
    (data_dir / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({"data": RunsCode(marker)}, protocol=2))
    with pytest.raises(ConfigError, match=r"test_batch is truncated or corrupt \(UnpicklingError: unexpected global"):
        load_split(data_dir, train=False, verify=False)
    assert not marker.exists()


def dump(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


BAD_BATCHES = {  # what data_batch_2 holds -> what the error says after the file's name
    "float data": (
        {"data": np.zeros((3, 3072), np.float32), "labels": [0, 1, 2]},
        r": 'data' is float32 with shape \(3, 3072\), expected uint8",
    ),
    "wrong width": (
        {"data": np.zeros((3, 3000), np.uint8), "labels": [0, 1, 2]},
        r": 'data' is uint8 with shape \(3, 3000\)",
    ),
    "3-d data": (
        {"data": np.zeros((3, 32, 96), np.uint8), "labels": [0, 1, 2]},
        r": 'data' is uint8 with shape \(3, 32, 96\), expected uint8 \(N, 3072\)",
    ),
    "label count": (
        {"data": np.zeros((3, 3072), np.uint8), "labels": [0, 1]},
        r": 3 images but 'labels' has shape \(2,\)",
    ),
    "label 10": (
        {"data": np.zeros((3, 3072), np.uint8), "labels": [0, 10, 2]},
        r": labels range 0\.\.10, expected 0\.\.9",
    ),
    "label -1": ({"data": np.zeros((3, 3072), np.uint8), "labels": [0, -1, 2]}, r": labels range -1\.\.2"),
    "text labels": (
        {"data": np.zeros((3, 3072), np.uint8), "labels": ["a", "b", "c"]},
        r": 'labels' is not a list of integers",
    ),
    "float labels": (
        {"data": np.zeros((3, 3072), np.uint8), "labels": [0.0, 1.5, 2.0]},
        r": 'labels' is not a list of integers \(float64\)",
    ),
    "no labels": ({"data": np.zeros((3, 3072), np.uint8)}, r" is not a CIFAR10 batch"),
    "a list": ([1, 2, 3], r" is not a CIFAR10 batch"),
}


@pytest.mark.parametrize("case", BAD_BATCHES, ids=list(BAD_BATCHES))
def test_wrong_shapes_dtypes_and_labels_are_named(data_dir, case):
    obj, pattern = BAD_BATCHES[case]
    dump(data_dir / "cifar-10-batches-py" / "data_batch_2", obj)
    with pytest.raises(ConfigError, match="data_batch_2" + pattern):
        load_split(data_dir, train=True, verify=False)


def test_meta_without_ten_label_names_is_refused(data_dir):
    dump(data_dir / "cifar-10-batches-py" / "batches.meta", {"label_names": ["cat", "dog"]})
    with pytest.raises(ConfigError, match="batches.meta: expected 'label_names' with 10 names"):
        load_split(data_dir, train=False, verify=False)


# ---------------------------------------------------------------------------------------------------
# Pipelines


def expected_batches(world_size: int, rank: int, epoch: int, seed: int = 5, consumed: int = 0) -> list[list[int]]:
    """This rank's sampler indices for the epoch, in batches of BATCH, the partial one dropped."""
    sampler = TrainSampler(N_TRAIN, rank, world_size, seed=seed)
    sampler.set_epoch(epoch, consumed=consumed)
    indices = list(sampler)
    return [indices[i : i + BATCH] for i in range(0, len(indices) - BATCH + 1, BATCH)]


def make_train_loader(pipeline: str, index_data, world_size: int = 1, rank: int = 0, seed: int = 5, **kwargs):
    sampler = TrainSampler(N_TRAIN, rank, world_size, seed=seed)
    split = Split(index_data["train_images"], index_data["train_labels"])
    loader = train_loader(split, sampler, BATCH, pipeline, "cpu", seed=seed, rank=rank, **kwargs)
    return loader, sampler


def batches_of(loader) -> list[list[int]]:
    return [decode(images) for images, _ in loader]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_gets_its_sampler_shard_in_batches(index_data, pipeline, world_size):
    seen: set[int] = set()
    for rank in range(world_size):
        loader, sampler = make_train_loader(pipeline, index_data, world_size, rank)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            expected = expected_batches(world_size, rank, epoch)
            assert len(loader) == len(expected) == (N_TRAIN // world_size) // BATCH
            batches = []
            for images, labels in loader:
                assert images.dtype == torch.float32 and images.shape == (BATCH, 3, 32, 32)
                assert labels.dtype == torch.int64 and labels.tolist() == [i % 10 for i in decode(images)]
                batches.append(decode(images))
            assert batches == expected
            if epoch == 0:
                assert not seen & set(sum(batches, [])), "two ranks got the same sample in one epoch"
                seen |= set(sum(batches, []))
    assert expected_batches(world_size, 0, 0) != expected_batches(world_size, 0, 1)  # epochs are reshuffled


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_full_pass_moves_the_sampler_to_the_next_epoch(index_data, pipeline):
    loader, sampler = make_train_loader(pipeline, index_data, 2, 1)
    first, second = batches_of(loader), batches_of(loader)  # no set_epoch in between
    assert first == expected_batches(2, 1, 0) and second == expected_batches(2, 1, 1) and sampler.epoch == 2


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_set_epoch_with_consumed_yields_exactly_the_rest_of_the_epoch(index_data, pipeline):
    loader, sampler = make_train_loader(pipeline, index_data, 2, 0)
    sampler.set_epoch(3)
    full = batches_of(loader)
    for k in (1, 4, len(full) - 1, len(full)):
        sampler.set_epoch(3, consumed=k * BATCH * 2)  # k batches of each of the 2 ranks
        assert len(loader) == len(full) - k
        assert batches_of(loader) == full[k:]


def test_without_augmentation_the_pipelines_give_identical_tensors(index_data):
    rng = np.random.default_rng(1)
    images = torch.from_numpy(rng.integers(0, 256, (N_TRAIN, 32, 32, 3), dtype=np.uint8))
    data = dict(index_data, train_images=images)
    batches = {}
    for pipeline in PIPELINES:
        loader, _ = make_train_loader(pipeline, data, 2, 1, augment=False)
        batches[pipeline] = list(loader)
    assert len(batches["tensor"]) == len(batches["torchvision"]) > 0
    for (x_tensor, y_tensor), (x_vision, y_vision) in zip(batches["tensor"], batches["torchvision"]):
        assert torch.equal(x_tensor, x_vision) and torch.equal(y_tensor, y_vision)


@pytest.mark.parametrize("pipeline,workers", [("tensor", 0), ("torchvision", 0), ("torchvision", 2)])
def test_augmentation_resumes_bitwise_from_the_rng_state_a_checkpoint_saves(index_data, pipeline, workers):
    """Stop after k batches, as a checkpoint would; restore the RNG state and the position; same batches.

    With workers, the resumed loader starts new worker processes: only per-sample seeds can replay them."""
    rng = np.random.default_rng(2)
    data = dict(index_data, train_images=torch.from_numpy(rng.integers(0, 256, (N_TRAIN, 32, 32, 3), dtype=np.uint8)))
    k = 3
    loader, sampler = make_train_loader(pipeline, data, 2, 1, **({"num_workers": workers} if workers else {}))
    torch.manual_seed(7)
    sampler.set_epoch(1)
    full, state = [], None
    for images, _ in loader:
        full.append(images)
        if len(full) == k:
            state = get_rng_state()

    torch.manual_seed(1234)  # a fresh process: other RNG state, new loader
    resumed_loader, resumed_sampler = make_train_loader(
        pipeline, data, 2, 1, **({"num_workers": workers} if workers else {})
    )
    set_rng_state(state)
    resumed_sampler.set_epoch(1, consumed=k * BATCH * 2)
    rest = [images for images, _ in resumed_loader]
    assert len(rest) == len(full) - k
    assert all(torch.equal(a, b) for a, b in zip(rest, full[k:]))
    assert not torch.equal(full[k], full[k + 1])


def test_augmentation_differs_between_epochs_and_looks_like_crops_and_flips(index_data):
    rng = np.random.default_rng(4)
    data = dict(index_data, train_images=torch.from_numpy(rng.integers(0, 256, (N_TRAIN, 32, 32, 3), dtype=np.uint8)))
    torch.manual_seed(0)
    loader, sampler = make_train_loader("tensor", data, augment=True)
    plain, _ = make_train_loader("tensor", data, augment=False)
    augmented, reference = next(iter(loader))[0], next(iter(plain))[0]
    zero = (0 - torch.tensor(MEAN)) / torch.tensor(STD)
    padded = (augmented[:, :, 0, :] == zero.view(1, 3, 1)).all(dim=(1, 2)) | (
        augmented[:, :, -1, :] == zero.view(1, 3, 1)
    ).all(dim=(1, 2))
    assert 0 < padded.sum() < BATCH  # some images were shifted vertically (a zero row at the top or bottom)
    assert (augmented != reference).flatten(1).any(dim=1).float().mean() > 0.5


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_evaluation_covers_the_test_set_once_without_augmentation(index_data, pipeline, world_size):
    seen = []
    for rank in range(world_size):
        loader = eval_batches(
            Split(index_data["test_images"], index_data["test_labels"]), rank, world_size, 16, "cpu", pipeline
        )
        for images, labels in loader:
            indices = decode(images)
            assert labels.tolist() == [i % 10 for i in indices]
            reference = (
                index_data["test_images"][indices].permute(0, 3, 1, 2).float() / 255 - torch.tensor(MEAN).view(3, 1, 1)
            ) / torch.tensor(STD).view(3, 1, 1)
            assert (images - reference).abs().max() < 1e-5  # normalised, not augmented
            seen += indices
        assert len(loader) == -(-len(range(rank, N_TEST, world_size)) // 16)
    assert sorted(seen) == list(range(N_TEST))


def test_evaluation_tensors_are_identical_between_the_pipelines(index_data):
    rng = np.random.default_rng(6)
    images = torch.from_numpy(rng.integers(0, 256, (N_TEST, 32, 32, 3), dtype=np.uint8))
    out = {
        pipeline: list(eval_batches(Split(images, index_data["test_labels"]), 1, 2, 16, "cpu", pipeline))
        for pipeline in PIPELINES
    }
    assert len(out["tensor"]) == len(out["torchvision"]) == 4  # 50 samples: 16, 16, 16, 2
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(out["tensor"], out["torchvision"]))


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_channels_last(index_data, pipeline):
    plain = next(iter(make_train_loader(pipeline, index_data, augment=False)[0]))[0]
    images = next(iter(make_train_loader(pipeline, index_data, augment=False, channels_last=True)[0]))[0]
    assert images.is_contiguous(memory_format=torch.channels_last) and torch.equal(images, plain)
    test_split = Split(index_data["test_images"], index_data["test_labels"])
    evaluated = next(iter(eval_batches(test_split, 0, 1, 8, "cpu", pipeline, channels_last=True)))[0]
    assert evaluated.is_contiguous(memory_format=torch.channels_last)


def test_torchvision_pipeline_workers_are_seeded_per_rank_and_persist(index_data):
    loader, sampler = make_train_loader("torchvision", index_data, 2, 1, num_workers=1)
    dataloader = loader.loader
    assert dataloader.persistent_workers and dataloader.worker_init_fn is worker_init_fn and dataloader.drop_last
    assert not dataloader.pin_memory  # CPU here; pinned only for CUDA
    assert torch.equal(dataloader.generator.get_state(), loader_generator(5, 1).get_state())
    assert batches_of(loader) == expected_batches(2, 1, 0)  # indices come from the main process's sampler
    assert batches_of(loader) == expected_batches(2, 1, 1)  # the same (persistent) worker, next epoch
    del loader, dataloader


def test_an_unknown_pipeline_is_a_config_error(index_data):
    with pytest.raises(ConfigError, match="input pipeline 'dali' is not one of tensor, torchvision"):
        make_train_loader("dali", index_data)


def test_image_grid_undoes_the_normalisation(index_data):
    batch = next(iter(eval_batches(Split(index_data["test_images"], index_data["test_labels"]), 0, 1, 10, "cpu")))[0]
    grid = image_grid(batch, columns=4, border=2)
    assert grid.shape == (3, 3 * 34 + 2, 4 * 34 + 2) and 0 <= grid.min() and grid.max() <= 1
    # image 5 (second row, second column) is filled with the bytes (5, 0, 35)
    assert torch.allclose(grid[:, 2 + 34 + 10, 2 + 34 + 10], torch.tensor([5, 0, 35]) / 255, atol=1e-6)
    assert torch.equal(grid[:, 0, :], torch.ones(3, 4 * 34 + 2))  # the border


# ---------------------------------------------------------------------------------------------------
# Learnable synthetic images


def test_learnable_images_are_deterministic_and_balanced():
    images, labels = make_learnable_images(200, seed=3)
    assert images.dtype == torch.uint8 and images.shape == (200, 32, 32, 3) and labels.dtype == torch.int64
    assert torch.bincount(labels, minlength=10).tolist() == [20] * 10
    again, again_labels = make_learnable_images(200, seed=3)
    assert torch.equal(images, again) and torch.equal(labels, again_labels)
    assert not torch.equal(make_learnable_images(200, seed=4)[0], images)
    same_class = images[labels == 0].float()
    assert same_class.std(dim=0).mean() > 10  # images of a class vary (noise, phase, brightness)


def test_a_small_cnn_learns_the_synthetic_classes_through_the_augmented_tensor_pipeline(tmp_path):
    torch.manual_seed(0)
    train_images, train_labels = make_learnable_images(2000, seed=0)
    test_images, test_labels = make_learnable_images(500, seed=1)
    write_cifar10_format(tmp_path, train_images, train_labels, test_images, test_labels)
    train_split = load_split(tmp_path, train=True, verify=False)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = TrainSampler(len(train_split.labels), 0, 1, seed=0)
    loader = train_loader(train_split, sampler, 64, "tensor", "cpu")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    correct = 0
    with torch.no_grad():
        for images, labels in eval_batches(load_split(tmp_path, train=False, verify=False), 0, 1, 250, "cpu"):
            correct += (model(images).argmax(1) == labels).sum().item()
    assert correct / len(test_labels) > 0.8  # chance is 0.1; it reaches 0.95-1.0
