"""After backward, DDP leaves the same gradient on every rank: the gradient of the mean loss on the global batch."""

from __future__ import annotations

import torch
from torch import nn

from experiments.toy import ToyModel
from tests.distributed.harness import section
from tests.distributed.workers import LOCAL_BATCH, global_batch


def _reference_grads(
    initial: dict[str, torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, torch.Tensor]:
    model = ToyModel()
    model.load_state_dict(initial)
    nn.MSELoss()(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_model_is_ddp_wrapped_and_identically_initialised(world_runs, world_size):
    per_rank = section(world_runs[world_size], "gradients")
    for rank, out in enumerate(per_rank):
        assert out["type"] == "DistributedDataParallel"
        assert out["initial"].keys() == per_rank[0]["initial"].keys()
        for name, value in out["initial"].items():
            assert torch.equal(value, per_rank[0]["initial"][name]), f"rank {rank}: {name}"


def test_gradients_bitwise_equal_across_ranks(world_runs, world_size):
    per_rank = section(world_runs[world_size], "gradients")
    names = [name for name, _ in ToyModel().named_parameters()]
    for rank, out in enumerate(per_rank):
        assert list(out["grads"]) == names
        for name in names:
            assert torch.equal(out["grads"][name], per_rank[0]["grads"][name]), (
                f"rank {rank} differs from rank 0 in {name}.grad"
            )


def test_gradients_equal_single_model_on_global_batch(world_runs, world_size):
    per_rank = section(world_runs[world_size], "gradients")
    inputs, targets = global_batch(world_size)
    assert inputs.shape[0] == world_size * LOCAL_BATCH
    expected = _reference_grads(per_rank[0]["initial"], inputs, targets)
    for rank, out in enumerate(per_rank):
        for name, grad in expected.items():
            torch.testing.assert_close(
                out["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}.grad: {m}"
            )


def test_each_ranks_local_gradient_differs(world_runs, world_size):
    """The inputs really differ per rank: without DDP's all-reduce the gradients would not agree."""
    per_rank = section(world_runs[world_size], "gradients")
    inputs, targets = global_batch(world_size)
    local = [
        _reference_grads(
            per_rank[0]["initial"],
            inputs[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH],
            targets[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH],
        )
        for r in range(world_size)
    ]
    for r in range(1, world_size):
        assert not torch.allclose(local[r]["net1.weight"], local[0]["net1.weight"])
    # and their mean is the global gradient (equal local batch sizes)
    for name, grad in per_rank[0]["grads"].items():
        torch.testing.assert_close(sum(g[name] for g in local) / world_size, grad, rtol=1e-5, atol=1e-6)


def test_a_resume_replays_its_first_step_and_ends_it_as_a_run_that_never_stopped(world_runs, world_size):
    """ddp_core.training.buckets: the first step after a resume runs once (undone) so DDP rebuilds its buckets,
    then for real; its weights then equal, bit for bit, those of the run that never stopped (dropout, batch norm
    and momentum included). At 2 ranks the order cannot matter, and the run does not replay."""
    for rank, out in enumerate(section(world_runs[world_size], "bucket_settling")):
        assert out["seen_first"] == [1, 1, 0] and out["active"] == [True, False, False], f"rank {rank}: {out}"
        assert out["weights_equal"] and out["buffers_equal"], f"rank {rank}: the resumed step differs"
        assert out["rebuilt"] is True, f"rank {rank}"
        assert out["decides"] is (world_size >= 3), f"rank {rank}"
        assert out["find_unused_skipped"] and out["plain_model_skipped"], f"rank {rank}"


def test_a_non_finite_loss_on_any_rank_stops_every_rank_naming_the_earliest(world_runs, world_size):
    """Rank 2 (world 3) goes bad at step 5, rank 1 at step 7: every rank stops, naming step 5 and rank 2;
    in a world of 2 only rank 1 is bad."""
    expected = "step 5 (rank 2)" if world_size == 3 else "step 7 (rank 1)"
    for rank, out in enumerate(section(world_runs[world_size], "non_finite_guard")):
        assert out["raised"], f"rank {rank} went on"
        assert f"became nan at {expected}" in out["message"], (rank, out["message"])
