"""Networks for the CIFAR10 experiment. Both use BatchNorm, which the experiment synchronises across ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddp_core.distributed.sync_batchnorm import convert_sync_batchnorm

MODELS = ("resnet18", "small")


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 inputs: torchvision's network with a 3x3 stride-1 stem and no max-pool.

    The ImageNet stem (7x7 stride 2, then max-pool) would shrink a 32x32 image to 8x8 before the first block.
    """
    from torchvision.models import resnet18  # torchvision is slow to import: only when this model is built

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


def small_cnn(num_classes: int = 10) -> nn.Module:
    """About 0.24 M parameters: trains to well above chance in minutes on two CPU cores."""
    return nn.Sequential(
        conv_bn(3, 32),
        nn.MaxPool2d(2),  # 16x16
        conv_bn(32, 64),
        nn.MaxPool2d(2),  # 8x8
        conv_bn(64, 128),
        conv_bn(128, 128),
        nn.MaxPool2d(2),  # 4x4
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    if name == "resnet18":
        return cifar_resnet18(num_classes)
    if name == "small":
        return small_cnn(num_classes)
    raise ValueError(f"model {name!r}: use one of {', '.join(MODELS)}")


def sync_bn_choice(requested: str, device: torch.device, compiled: bool) -> str:
    """auto: torch's SyncBatchNorm for eager CUDA (fused kernels, measured on GPUs before), ddp-lab's GlobalBatchNorm
    when compiled (torch's breaks the graph at every layer and reads a mask on the host) and on CPU."""
    if requested != "auto":
        return requested
    return "torch" if device.type == "cuda" and not compiled else "global"


def build_synced(name: str, classes: int, device: torch.device, sync_bn: str | None, channels_last: bool) -> nn.Module:
    """The network, its batch norm synchronized across the ranks by ``sync_bn`` (None: per rank), before the DDP
    wrap; channels_last for autocast's convolutions."""
    model = build_model(name, num_classes=classes)
    if sync_bn is not None:
        model = convert_sync_batchnorm(model, device, sync_bn)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def compile_forward(model: nn.Module, compile: bool, cuda_graphs: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module the training step calls: the DDP model itself, compiled, or compiled and replayed as CUDA graphs.

    Under CUDA graphs each call first marks a new step, so the graphs' output buffers from the step
    before may be reused (the loss and the guard have read them by then); the parameters, updated in
    place by the optimizer and by a resume's load, keep the addresses the graphs were recorded with."""
    if not (compile or cuda_graphs):
        return model
    module = torch.compile(model, mode="reduce-overhead" if cuda_graphs else None)
    if not cuda_graphs:
        return module

    def forward(images: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return module(images)

    return forward
