"""Stop cleanly on SIGTERM or SIGINT: a signal only sets a flag, and the ranks agree at a step boundary, so all
stop after the same step with one checkpoint (docs/decisions.md, "Stopping, diverging, disagreeing").
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

import torch
import torch.distributed as dist

from ddp_core.distributed.collectives import comm_device
from ddp_core.distributed.group import launcher_signalled
from ddp_core.exit_codes import STOPPED_EXIT_CODE

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What the run logs when a signal stopped it (every rank logs it; global rank 0's line is shown: output/logging.py)
STOPPED_BY_SIGNAL = "stopped by a signal after step {step}; to continue: {command}"
STOPPED_AS_ASKED = "stopped as asked at step {step} of {total_steps}; to continue: {command}"
log = logging.getLogger(__name__)


class GracefulStop:
    """Context manager: catch the stop signals while training, restore the previous handlers after."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self.stopped = False  # set by requested(): every rank agreed to stop
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers there only
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None and self.received == signal.SIGTERM and not self.stopped:
            launcher_signalled.set()  # the run failed before it could stop for it: no rank waits for another
        if self.stopped:
            return  # about to exit: a second signal (the launcher passes a stop on as SIGTERM) must not cut it short
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        self.received = signal.Signals(signum)

    def requested(self) -> bool:
        """Collective (every rank calls it at the same step): did any rank get a stop signal?"""
        local = self.received is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(local)], device=comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = bool(flag.item())
        self.stopped = self.stopped or local
        return self.stopped

    def agree(self, any_rank: bool) -> bool:
        """``requested``'s answer from every rank's flag read among a log point's figures (no collective of its own)."""
        self.stopped = self.stopped or any_rank
        return self.stopped

    def report(self, step: int, run_dir: str | Path, total_steps: int) -> None:
        """Every rank, after an early stop's checkpoint: one WARNING (shown by global rank 0) naming the step."""
        command = resume_command(run_dir)
        if self.stopped:
            log.warning(STOPPED_BY_SIGNAL.format(step=step, command=command))
        else:
            log.warning(STOPPED_AS_ASKED.format(step=step, total_steps=total_steps, command=command))

    def exit_if_stopped(self) -> None:
        """Call after the process group is gone: a stopped run exits with STOPPED_EXIT_CODE."""
        if self.stopped:
            raise SystemExit(STOPPED_EXIT_CODE)


def resume_command(run_dir: str | Path) -> str:
    """The command that continues the run, as it can be typed: the resume takes every other option from the
    checkpoint (ddp_core/output/resume.py). Under torchrun, whose command this process does not know: its flags."""
    resume = f"--resume --run-dir {shlex.quote(str(run_dir))}"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if "TORCHELASTIC_RUN_ID" in os.environ or spec is None or not spec.name:
        return f"the same launch command with {resume} as the program's flags"
    return f"python -m {spec.name.removesuffix('.__main__')} {resume}"
