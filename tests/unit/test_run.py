"""Run-directory decisions that need no process group."""

from __future__ import annotations

import pytest

from ddp_core.errors import ConfigError
from ddp_core.run import _refuse_a_checkpoint_on_another_host


def test_a_checkpoint_only_on_another_host_is_refused_naming_both():
    seen = [("node-b", None), ("node-a", "runs/toy/x/checkpoints/last.pt")]  # c10d made node-b rank 0
    with pytest.raises(ConfigError, match=r"rank 0 \(host node-b\) has no checkpoint .* rank 1 \(host node-a\) has runs/toy/x/checkpoints/last\.pt"):
        _refuse_a_checkpoint_on_another_host(seen)


@pytest.mark.parametrize("seen", [
    [("node-a", None), ("node-b", None)],  # nobody has one: the usual rules apply
    [("node-a", None), ("node-a", "runs/toy/x/checkpoints/last.pt")],  # same host: rank 0 would see it too
])
def test_no_refusal_without_a_checkpoint_elsewhere(seen):
    _refuse_a_checkpoint_on_another_host(seen)


@pytest.mark.parametrize(("device", "deterministic", "warned"), [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)])
def test_a_cuda_resume_without_deterministic_says_it_will_not_be_bitwise(tmp_path, caplog, device, deterministic, warned):
    """No GPU is touched: the decision reads only the device's type (a torch.device needs no CUDA)."""
    import torch

    from ddp_core.dist import DistContext
    from ddp_core.env import DistEnv
    from ddp_core.run import CHECKPOINT_NAME, start_run
    from experiments.toy import ToyArgs

    run_dir = tmp_path / "run"
    (run_dir / CHECKPOINT_NAME).parent.mkdir(parents=True)
    (run_dir / CHECKPOINT_NAME).write_bytes(b"a checkpoint")
    args = ToyArgs(run_dir=str(run_dir), deterministic=deterministic)
    ctx = DistContext(env=DistEnv(), backend="nccl" if device == "cuda" else "gloo", device=torch.device(device, 0) if device == "cuda" else torch.device(device))
    with caplog.at_level("WARNING"):
        run = start_run("toy", args, ctx, resume=True)
    assert run.resume
    lines = [r.getMessage() for r in caplog.records if "--deterministic" in r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines
