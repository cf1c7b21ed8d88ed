"""Host values to the device without making the host wait for the GPU: a copy from pageable memory synchronizes,
one from pinned memory is queued like a kernel. States to the host as copies of their own (a checkpoint's)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (on the host) on ``device``: on CUDA through pinned memory, queued behind the stream's work."""
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values.to(device)


def rebuilt(state: Any, leaf: Callable[[Any], Any]) -> Any:
    """``state`` with its dicts (type and attributes, e.g. ``_metadata``, kept), lists and tuples rebuilt, ``leaf``
    applied to the rest."""
    if isinstance(state, dict):
        copied = copy.copy(state)
        for key, value in state.items():
            copied[key] = rebuilt(value, leaf)
        return copied
    if isinstance(state, (list, tuple)):
        values = [rebuilt(value, leaf) for value in state]
        if isinstance(state, list):
            return values
        return type(state)(*values) if hasattr(state, "_fields") else tuple(values)
    return leaf(state)


def to_host(state: Any) -> Any:
    """``state`` with every tensor copied to CPU memory of its own, so later steps cannot change what is written."""
    return rebuilt(state, _host_copy)


def _host_copy(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    return value.clone() if value.device.type == "cpu" else value.to("cpu")
