"""Mixed precision: bf16 autocast where native (float32's range: no scaler), else fp16 with a GradScaler, whose
state the checkpoint holds (docs/decisions.md, "CIFAR10")."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

AMP_DTYPES = ("auto", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AmpPlan:
    """Autocast on ``device_type`` with ``dtype``, or off (``dtype`` None)."""

    device_type: str
    dtype: torch.dtype | None = None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def needs_scaler(self) -> bool:
        return self.dtype == torch.float16  # float16's narrow range: small gradients underflow unscaled

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=self.enabled)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Enabled for float16 only; disabled, each of its methods leaves tensors and the step unchanged."""
        return torch.amp.GradScaler(self.device_type, enabled=self.needs_scaler)

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        name = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        return f"{name} + GradScaler" if self.needs_scaler else name


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (every CPU does; a V100 only emulates it)."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)


def choose_amp(device: torch.device, amp: bool | None, dtype: str = "auto") -> AmpPlan:
    """``dtype`` auto: bf16 where native, else fp16; bf16 or fp16 forces it and turns autocast on. ``amp`` None: on
    with CUDA or a forced dtype; False: off."""
    if dtype not in AMP_DTYPES:
        raise ValueError(f"amp dtype {dtype!r}: use one of {', '.join(AMP_DTYPES)}")
    if amp is None:
        amp = device.type == "cuda" or dtype != "auto"
    if not amp:
        return AmpPlan(device.type)
    if dtype == "auto":
        dtype = "bf16" if native_bf16(device) else "fp16"
    return AmpPlan(device.type, _DTYPES[dtype])


class ScalerState:
    """The GradScaler's state as a part of the checkpoint (None unless fp16); a mismatch on load warns."""

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler
        self.warn = True  # off while a resume's replay loads the checkpoint a second time

    @property
    def enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None and self.enabled else None

    def snapshot(self) -> dict[str, Any] | None:
        """A copy of the scaler's state now: a resume's replayed first step is undone to it."""
        return copy.deepcopy(self.scaler.state_dict()) if self.scaler is not None and self.enabled else None

    def put_back(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.scaler is not None:
            self.scaler.load_state_dict(state)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        mismatch = None
        if self.scaler is not None and self.enabled and state:
            self.scaler.load_state_dict(state)
        elif self.enabled:
            mismatch = (
                "the checkpoint holds no GradScaler state (it was written without fp16 autocast): "
                "the loss scale starts over"
            )
        elif state:
            mismatch = (
                "the checkpoint was written with fp16 autocast and a GradScaler, this run has none: "
                "its loss scale is dropped"
            )
        if mismatch and self.warn:
            log.warning("%s; this resume will not be exact", mismatch)
