"""Code that runs inside spawned ranks for test_cifar10.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed.harness import context


def download_then_build(rank: int, world_size: int, data_dir: str, calls_dir: str) -> dict[str, Any]:
    """--download with a stand-in downloader (no network here) that writes a small dataset in the real format.

    fetch_data runs inside the group here (the harness creates it first); the experiment calls it before.
    """
    from experiments import cifar10, cifar10_data

    def fake_download(root: str) -> None:
        (Path(calls_dir) / f"rank{rank}").touch()  # who downloaded
        train, test = cifar10_data.make_learnable_images(40, seed=0), cifar10_data.make_learnable_images(11, seed=1)
        cifar10_data.write_cifar10_format(root, train.images, train.labels, test.images, test.labels)

    cifar10_data.download = fake_download
    ctx = context()
    results: dict[str, Any] = {}
    for sync_bn in (True, False):
        args = cifar10.Cifar10Args(data_dir=data_dir, download=True, verify=False, model="small", sync_bn=sync_bn)
        train_set, test_set = cifar10.fetch_data(args)
        model = cifar10.build(args, ctx.device, ctx.world_size, channels_last=False)
        kinds = {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
        results[f"sync_bn={sync_bn}"] = {
            "train": len(train_set.labels),
            "test": len(test_set.labels),
            "bn": sorted(kinds),
        }
    return results
