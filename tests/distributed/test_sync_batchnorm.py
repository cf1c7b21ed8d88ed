"""Synchronized batch norm: on N ranks it equals BatchNorm over the concatenated global batch.

Each spawned world (2 ranks with equal batches; 3 ranks with batches 3, 5, 4 and a step where one rank's
batch is empty) runs ``sync_bn_workers.sync_bn_checks`` once; the tests compare its results with plain
nn.BatchNorm on the global batch, computed here in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_core.distributed.group import process_group
from ddp_core.distributed.sync_batchnorm import GlobalBatchNorm, _check_enough_values, convert_sync_batchnorm
from tests.distributed.harness import SpawnedWorlds, section
from tests.distributed.sync_bn_workers import (
    BATCH_SIZES,
    CASES,
    COMPILE_MODELS,
    DDP_BATCH_SIZES,
    EVAL_SIZES,
    LR,
    SGD_MOMENTUM,
    STEPS,
    bounds,
    case_data,
    compile_checks,
    conv_bn_model,
    ddp_data,
    make_bn,
    sync_bn_checks,
)
from tests.distributed.test_init_failures import LAUNCH_ENV
from tests.distributed.workers import _count_collectives

TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32: different summation orders, nothing more


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory: pytest.TempPathFactory) -> SpawnedWorlds:
    return SpawnedWorlds(sync_bn_checks, tmp_path_factory)


def _reference_run(case: str, world_size: int) -> dict[str, Any]:
    """Plain BatchNorm on the global batch, the same steps and losses as the ranks, in this process."""
    bn = make_bn(case)
    steps = []
    for step, sizes in enumerate(BATCH_SIZES[world_size]):
        x, w = case_data(case, sizes, step)
        x.requires_grad_()
        y = bn(x)
        (y * w).sum().backward()
        steps.append(
            {
                "y": y.detach(),
                "x_grad": x.grad,
                "weight_grad": None if bn.weight is None else bn.weight.grad.clone(),
                "bias_grad": None if bn.bias is None else bn.bias.grad.clone(),
            }
        )
        bn.zero_grad(set_to_none=True)
    bn.eval()
    return {"bn": bn, "steps": steps, "state": bn.state_dict()}


@pytest.mark.parametrize("case", list(CASES))
def test_training_steps_equal_batchnorm_on_global_batch(sync_runs, world_size, case):
    per_rank = [r[case] for r in section(sync_runs[world_size], "functional")]
    ref = _reference_run(case, world_size)
    for step, sizes in enumerate(BATCH_SIZES[world_size]):
        expected = ref["steps"][step]
        for rank, out in enumerate(per_rank):
            got, rows, where = out["steps"][step], bounds(sizes, rank), f"rank {rank}, step {step}"
            assert out["type"] == "GlobalBatchNorm"
            torch.testing.assert_close(got["y"], expected["y"][rows], **TOL, msg=lambda m: f"{where}, output: {m}")
            torch.testing.assert_close(
                got["x_grad"], expected["x_grad"][rows], **TOL, msg=lambda m: f"{where}, input grad: {m}"
            )
            if got["y_channels_last"] is not None:
                assert got["y_channels_last"], f"{where}: a channels_last input gave an output in another memory format"
        # weight and bias gradients are local: their sum over ranks is the gradient of the global loss
        for name in ("weight_grad", "bias_grad"):
            if expected[name] is None:
                assert all(out["steps"][step][name] is None for out in per_rank)
                continue
            total = sum(out["steps"][step][name] for out in per_rank)
            torch.testing.assert_close(total, expected[name], **TOL, msg=lambda m: f"step {step}, sum of {name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_running_statistics_and_eval_output_equal_batchnorm(sync_runs, world_size, case):
    per_rank = [r[case] for r in section(sync_runs[world_size], "functional")]
    ref = _reference_run(case, world_size)
    x_eval, _ = case_data(case, EVAL_SIZES[world_size], 99)
    with torch.no_grad():
        expected_eval = ref["bn"](x_eval)
    for rank, out in enumerate(per_rank):
        assert list(out["state"]) == list(ref["state"]), f"rank {rank}: state_dict keys"
        for key, value in ref["state"].items():
            if key == "num_batches_tracked":
                assert out["state"][key].item() == value.item() == STEPS, f"rank {rank}: {key}"
            else:
                torch.testing.assert_close(out["state"][key], value, **TOL, msg=lambda m: f"rank {rank}, {key}: {m}")
        rows = bounds(EVAL_SIZES[world_size], rank)
        if ref["bn"].track_running_stats:
            expected = expected_eval[rows]
        else:  # no running statistics: eval normalises each rank's own batch, as BatchNorm (and SyncBatchNorm) do
            with torch.no_grad():
                expected = ref["bn"](x_eval[rows])
        torch.testing.assert_close(out["eval_y"], expected, **TOL, msg=lambda m: f"rank {rank}, eval output: {m}")


def test_one_collective_per_forward_and_per_backward(sync_runs, world_size):
    for rank, result in enumerate(section(sync_runs[world_size], "functional")):
        for case, out in result.items():
            for step, got in enumerate(out["steps"]):
                assert got["forward_calls"] == {"all_gather": 1}, f"rank {rank}, {case}, step {step}"
                assert got["backward_calls"] == {"all_reduce": 1}, f"rank {rank}, {case}, step {step}"
            assert out["eval_calls"] == {}, f"rank {rank}, {case}: eval mode must not communicate"


def test_a_global_batch_of_one_value_per_channel_fails_on_every_rank(sync_runs, world_size):
    messages = section(sync_runs[world_size], "too_few")
    assert (
        messages
        == [f"Expected more than 1 value per channel when training, got 1 across {world_size} ranks"] * world_size
    )


def test_the_count_is_read_only_by_a_rank_that_cannot_prove_it_from_its_own_shape():
    """A rank with 2+ values per channel knows the global batch has 2+ without reading the device."""

    class Unreadable:
        def item(self):
            raise AssertionError("the global count was read")

    _check_enough_values(2, Unreadable(), 2)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="was read"):
        _check_enough_values(1, Unreadable(), 2)  # type: ignore[arg-type]
    _check_enough_values(0, torch.tensor(5.0, dtype=torch.float64), 3)  # an empty rank in a big enough batch


def test_local_statistics_would_differ(world_size):
    """The check is discriminating: BatchNorm on one rank's slice alone does not give the global result."""
    sizes = BATCH_SIZES[world_size][0]
    x, w = case_data("bn2d", sizes, 0)
    global_bn, local_bn = make_bn("bn2d"), make_bn("bn2d")
    xg, xl = x.clone().requires_grad_(), x[bounds(sizes, 0)].clone().requires_grad_()
    (global_bn(xg) * w).sum().backward()
    (local_bn(xl) * w[bounds(sizes, 0)]).sum().backward()
    assert not torch.allclose(local_bn.running_mean, global_bn.running_mean, **TOL)
    assert not torch.allclose(xl.grad, xg.grad[bounds(sizes, 0)], **TOL)


def _reference_training(
    initial: dict[str, torch.Tensor], world_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = conv_bn_model()
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=SGD_MOMENTUM)
    first_grads = None
    for step in range(STEPS):
        inputs, targets = ddp_data(DDP_BATCH_SIZES[world_size], step)
        ((model(inputs) - targets) ** 2).sum().div(inputs.shape[0]).backward()  # mean over the global batch
        if first_grads is None:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return first_grads, model.state_dict()


def test_ddp_training_equals_one_process_on_global_batch(sync_runs, world_size):
    per_rank = section(sync_runs[world_size], "ddp")
    first_grads, final = _reference_training(per_rank[0]["initial"], world_size)
    for rank, out in enumerate(per_rank):
        assert out["types"][1] == out["types"][6] == "GlobalBatchNorm", f"rank {rank}: {out['types']}"
        for name, grad in first_grads.items():  # DDP's average of the ranks' gradients
            torch.testing.assert_close(
                out["first_grads"][name], grad, **TOL, msg=lambda m: f"rank {rank}, {name}.grad: {m}"
            )
        assert list(out["final"]) == list(final)
        for key, value in final.items():
            torch.testing.assert_close(out["final"][key], value, **TOL, msg=lambda m: f"rank {rank}, final {key}: {m}")


# ---------------------------------------------------------------- no process group / a world of one


def _bn_model() -> nn.Sequential:
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5, momentum=None)),
        nn.Unflatten(1, (5, 1, 1, 1)),
        nn.BatchNorm3d(5, affine=False),
    )
    model(torch.randn(6, 3, 6, 6))  # running statistics away from their initial values
    model[3][2].bias.requires_grad_(False)
    model[5].eval()
    return model


def _forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    y = model(x)
    (y * torch.linspace(-1, 2, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_convert_on_cpu_replaces_batchnorm_and_keeps_state():
    assert not dist.is_initialized()
    original = _bn_model()
    state = {k: v.clone() for k, v in original.state_dict().items()}
    expected = {
        name: (type(m), m.training)
        for name, m in original.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }
    converted = convert_sync_batchnorm(original, torch.device("cpu"))
    layers = {name: m for name, m in converted.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    assert set(layers) == set(expected) == {"1", "3.2", "5"}
    for name, module in layers.items():
        assert type(module) is GlobalBatchNorm, name
        assert module.training == expected[name][1], name
    assert list(converted.state_dict()) == list(state)
    for key, value in converted.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert converted[3][2].bias.requires_grad is False and converted[3][2].weight.requires_grad is True
    assert type(convert_sync_batchnorm(nn.BatchNorm1d(3), "cpu")) is GlobalBatchNorm  # a bare layer: a new object


def _bn_types(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_convert_on_cuda_uses_torch_sync_batchnorm_unless_told_global():
    cuda = torch.device("cuda", 0)  # builds modules only: no GPU needed
    assert _bn_types(convert_sync_batchnorm(_bn_model(), cuda)) == [nn.SyncBatchNorm] * 3
    assert _bn_types(convert_sync_batchnorm(_bn_model(), cuda, impl="torch")) == [nn.SyncBatchNorm] * 3
    assert _bn_types(convert_sync_batchnorm(_bn_model(), cuda, impl="global")) == [GlobalBatchNorm] * 3


def test_torch_sync_batchnorm_is_refused_off_cuda():
    with pytest.raises(ValueError, match="only works on CUDA"):
        convert_sync_batchnorm(_bn_model(), "cpu", impl="torch")
    with pytest.raises(ValueError, match="one of torch, global"):
        convert_sync_batchnorm(_bn_model(), "cpu", impl="apex")


def test_converted_model_without_group_is_batchnorm_bit_for_bit():
    assert not dist.is_initialized()
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(5))
    reference, converted = _bn_model(), convert_sync_batchnorm(_bn_model(), "cpu")
    for _ in range(2):  # the running statistics of the first step feed nothing but are compared below
        want, got = _forward_backward(reference, x), _forward_backward(converted, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            assert torch.equal(got[2][name], want[2][name]), name
    for key, value in reference.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value), key


def test_world_of_one_is_batchnorm_without_communication(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(6))
    reference, converted = _bn_model(), convert_sync_batchnorm(_bn_model(), "cpu")
    want = _forward_backward(reference, x)
    with process_group():
        assert dist.get_world_size() == 1
        got, calls = _count_collectives(lambda: _forward_backward(converted, x))
    assert not any(calls.values()), calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name


def test_input_without_channels_is_rejected():
    with pytest.raises(ValueError, match="at least 2D"):
        GlobalBatchNorm(3)(torch.randn(3))


# ---------------------------------------------------------------- torch.compile


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory: pytest.TempPathFactory) -> SpawnedWorlds:
    return SpawnedWorlds(compile_checks, tmp_path_factory)


@pytest.mark.parametrize("model", COMPILE_MODELS)
def test_cifar_models_compile_without_graph_breaks_in_a_real_group(compile_runs, model):
    """Every BatchNorm is a GlobalBatchNorm whose collectives dynamo traces: one graph, not one per layer
    (dist.all_gather into a list and a host read of the count each broke the graph before)."""
    for rank, result in enumerate(compile_runs[2]):
        explained = result[model]
        assert explained["global_bn_layers"] >= 4, f"rank {rank}: the model was not converted"
        assert (explained["graphs"], explained["breaks"]) == (1, 0), f"rank {rank}: {explained['reasons']}"


def test_the_experiments_compile_of_a_ddp_model_compiles_every_layer(compile_runs):
    """`--compile` at more than one rank compiles the DDP model: DDP's forward breaks the graph around the model's
    own forward, which dynamo traces as a frame of its own only where it is not torch's code. The small CNN is a
    bare nn.Sequential, as a user's model may be: before wrap_ddp gave it a forward of ddp_core's, it ran eagerly,
    its batch norms compiled one by one, and nothing said so."""
    for rank, result in enumerate(compile_runs[2]):
        counted = result["small"]["inside_ddp"]
        assert counted["convolutions"] >= 4 and counted["graphs"] >= 1, f"rank {rank}: {counted}"
        assert counted["compiled_convolutions"] == counted["convolutions"], f"rank {rank}: {counted}"


def test_a_compiled_training_step_equals_the_eager_one(compile_runs):
    for rank, result in enumerate(compile_runs[2]):
        eager, compiled = result["eager_step"], result["compiled_step"]
        assert compiled.keys() == eager.keys() and any(key.startswith("grad.") for key in eager)
        for key in eager:
            torch.testing.assert_close(compiled[key], eager[key], **TOL, msg=lambda m: f"rank {rank}, {key}: {m}")
