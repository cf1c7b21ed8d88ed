"""The speed switches every run gets, and CIFAR10's own: cuDNN autotuning on CUDA unless --deterministic, a test set
uploaded to the device once per run, in the training's memory format, and the synchronized batch norm
each device and mode gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddp_core.errors import ConfigError
from ddp_core.training.seed import speed_switches
from experiments import cifar10, cifar10_data, cifar10_models
from tests.distributed.test_init_failures import LAUNCH_ENV


@pytest.mark.parametrize(
    ("device", "deterministic", "expected"), [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)]
)
def test_cudnn_autotuning_only_on_cuda_and_never_with_deterministic(monkeypatch, device, deterministic, expected):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # restored after the test
    speed_switches(torch.device(device), deterministic)
    assert torch.backends.cudnn.benchmark is expected


@pytest.mark.parametrize(
    ("device", "flags", "expected"),
    [
        ("cuda", {}, "torch"),  # eager: torch's fused kernels
        ("cuda", {"compile": True}, "global"),  # compiled: one graph, no host read per layer
        ("cpu", {}, "global"),  # torch's refuses CPU tensors
        ("cuda", {"compile": True, "sync_bn_impl": "torch"}, "torch"),
        ("cuda", {"sync_bn_impl": "global"}, "global"),
        ("cuda", {"cuda_graphs": True}, "global"),  # graphed: compiled first
    ],
)
def test_the_sync_batchnorm_each_device_and_mode_gets(device, flags, expected):
    args = cifar10.Cifar10Args(**flags)
    assert cifar10.sync_bn(args, torch.device(device), world_size=2) == expected
    assert cifar10.sync_bn(args, torch.device(device), world_size=1) is None  # a world of one: plain BatchNorm
    assert cifar10.sync_bn(cifar10.Cifar10Args(**flags, sync_bn=False), torch.device(device), world_size=2) is None


def test_torch_sync_batchnorm_without_cuda_is_a_config_error(tmp_path, monkeypatch):
    cifar10_data.dataset_folder(tmp_path).mkdir(parents=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cifar10.validate(cifar10.Cifar10Args(data_dir=str(tmp_path), sync_bn_impl="torch"))
    with pytest.raises(ConfigError, match="--sync-bn-impl=torch needs CUDA"):
        cifar10.validate(cifar10.Cifar10Args(data_dir=str(tmp_path), sync_bn_impl="torch", backend="gloo"))


def test_cuda_graphs_without_cuda_are_a_config_error(tmp_path, monkeypatch):
    cifar10_data.dataset_folder(tmp_path).mkdir(parents=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cifar10.validate(cifar10.Cifar10Args(data_dir=str(tmp_path), cuda_graphs=True))
    for args in (dict(backend="gloo"), dict(compile=True, backend="gloo")):
        with pytest.raises(ConfigError, match="--cuda-graphs needs CUDA"):
            cifar10.validate(cifar10.Cifar10Args(data_dir=str(tmp_path), cuda_graphs=True, **args))


@pytest.mark.parametrize(
    ("flags", "mode", "marks"),
    [
        ({}, None, 0),
        ({"compile": True}, "default", 0),
        ({"cuda_graphs": True}, "reduce-overhead", 2),
        ({"compile": True, "cuda_graphs": True}, "reduce-overhead", 2),
    ],
)
def test_each_mode_reaches_torch_compile_and_graphs_mark_every_step(monkeypatch, flags, mode, marks):
    """--cuda-graphs is torch.compile's reduce-overhead mode, and each call of the step's forward first tells
    the graphs a new step began (so the buffers of the step before may be reused)."""
    compiled, events = [], []

    def fake_compile(model, mode=None):
        compiled.append(mode or "default")

        def module(images):
            events.append("forward")
            return model(images)

        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    model = torch.nn.Linear(2, 2)
    args = cifar10.Cifar10Args(**flags)
    forward = cifar10_models.compile_forward(model, args.compile, args.cuda_graphs)
    for _ in range(2):
        assert forward(torch.ones(1, 2)).shape == (1, 2)
    assert compiled == ([mode] if mode else [])
    assert forward is model if mode is None else events == (["mark", "forward"] * 2 if marks else ["forward"] * 2)


@pytest.fixture
def tiny_data(tmp_path: Path) -> Path:
    train, test = cifar10_data.make_learnable_images(64, seed=0), cifar10_data.make_learnable_images(21, seed=1)
    cifar10_data.write_cifar10_format(tmp_path / "data", train.images, train.labels, test.images, test.labels)
    return tmp_path / "data"


@pytest.mark.parametrize("amp", [True, False], ids=["amp", "no-amp"])
def test_the_test_set_is_built_once_and_evaluated_in_the_training_memory_format(monkeypatch, tmp_path, tiny_data, amp):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    built, layouts = [], []
    real = cifar10_data.eval_batches

    def spy(*args, **kwargs):
        loader = real(*args, **kwargs)
        built.append(loader)
        original_iter = type(loader).__iter__

        class Watched(type(loader)):  # records each evaluated batch's memory format
            def __iter__(self):
                for images, labels in original_iter(self):
                    layouts.append(images.is_contiguous(memory_format=torch.channels_last))
                    yield images, labels

        loader.__class__ = Watched
        return loader

    monkeypatch.setattr(cifar10_data, "eval_batches", spy)
    argv = [
        "--data-dir",
        str(tiny_data),
        "--no-verify",
        "--model",
        "small",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--eval-batch-size",
        "8",
        "--run-dir",
        str(tmp_path / "run"),
        "--amp" if amp else "--no-amp",
    ]
    metrics = cifar10.main(argv)
    assert metrics["eval_samples"] == 21 and metrics["amp"] == ("bf16" if amp else "off")
    assert len(built) == 1  # two evaluations, one upload
    assert len(layouts) == 2 * 3 and set(layouts) == {amp}  # 3 batches of at most 8 per evaluation
