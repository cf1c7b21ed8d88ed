"""TensorBoard event files and checkpoints come from global rank 0 only, whatever every rank asks for."""

from __future__ import annotations

from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core.layout import step_file_name
from ddp_core.output.checkpoint import FORMAT
from experiments.toy import ToyModel
from tests.distributed.harness import section
from tests.distributed.workers import CHECKPOINT_EPOCH, CHECKPOINT_STEP, FINAL_LOSS, HPARAMS, SCALARS


def _files(directory: Path) -> list[str]:
    return (
        sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()) if directory.exists() else []
    )


def test_only_rank_0_writes_event_files_and_checkpoints(world_runs, world_size):
    per_rank = section(world_runs[world_size], "rank_zero_output")
    assert [out["enabled"] for out in per_rank] == [True] + [False] * (world_size - 1)
    rank0 = _files(Path(per_rank[0]["dir"]))
    events = [name for name in rank0 if name.startswith("events.out.tfevents.")]
    assert len(events) == 1, rank0
    expected = events + ["last.pt", step_file_name(CHECKPOINT_STEP)]
    assert sorted(rank0) == sorted(expected), f"unexpected files (temp files left behind?): {rank0}"
    for rank in range(1, world_size):
        assert _files(Path(per_rank[rank]["dir"])) == [], f"rank {rank} wrote files"


def test_rank_0_event_file_holds_the_scalars(world_runs, world_size):
    per_rank = section(world_runs[world_size], "rank_zero_output")
    accumulator = EventAccumulator(per_rank[0]["dir"])
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("test/loss")] == SCALARS


def test_checkpoint_holds_every_ranks_rng_and_loads_weights_only(world_runs, world_size):
    per_rank = section(world_runs[world_size], "rank_zero_output")
    checkpoint = torch.load(Path(per_rank[0]["dir"]) / "last.pt", weights_only=True)
    assert checkpoint["format"] == FORMAT
    assert (checkpoint["step"], checkpoint["position"]["epoch"], checkpoint["world_size"]) == (
        CHECKPOINT_STEP,
        CHECKPOINT_EPOCH,
        world_size,
    )
    assert len(checkpoint["rng"]) == world_size
    for rank, out in enumerate(per_rank):  # in rank order, each rank's own state
        assert torch.equal(checkpoint["rng"][rank]["torch"], out["rng_torch"]), (
            f"rng[{rank}] is not rank {rank}'s state"
        )
    assert not torch.equal(checkpoint["rng"][0]["torch"], checkpoint["rng"][1]["torch"])
    momentum = [s["momentum_buffer"] for s in checkpoint["optimizer"]["state"].values()]
    assert len(momentum) == 4 and all(isinstance(m, torch.Tensor) for m in momentum)


def test_checkpoint_from_ddp_model_has_no_module_prefix_and_loads_into_plain_model(world_runs, world_size):
    per_rank = section(world_runs[world_size], "rank_zero_output")
    assert per_rank[0]["ddp_keys"] and all(
        k.startswith("module.") for k in per_rank[0]["ddp_keys"]
    )  # the wrapper's own keys
    state = torch.load(Path(per_rank[0]["dir"]) / "last.pt", weights_only=True)["model"]
    assert sorted(state) == sorted(ToyModel().state_dict())
    assert not any(key.startswith("module.") for key in state)
    model = ToyModel()
    model.load_state_dict(state)  # strict
    for name, value in model.state_dict().items():
        assert torch.equal(value, per_rank[0]["model"][name]), name


def test_hparams_go_into_the_same_event_file(world_runs, world_size):
    per_rank = section(world_runs[world_size], "rank_zero_output")
    accumulator = EventAccumulator(per_rank[0]["dir"])
    accumulator.Reload()
    assert accumulator.Scalars("hparam/final_loss")[0].value == FINAL_LOSS
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert {
        k: (
            v.number_value
            if v.HasField("number_value")
            else v.string_value
            if v.HasField("string_value")
            else v.bool_value
        )
        for k, v in start.hparams.items()
    } == HPARAMS


def test_console_output_comes_from_rank_0_with_a_rank_prefix(world_runs, world_size):
    per_rank = section(world_runs[world_size], "console")
    rank0 = per_rank[0]["stdout"]
    assert "print0 from rank 0" in rank0
    for line in ("INFO info", "WARNING warning", "WARNING own warning", "ERROR error"):
        assert f"[rank 0/{world_size}] {line} from rank 0" in rank0, rank0
    for rank in range(1, world_size):
        text = per_rank[rank]["stdout"]
        assert "print0" not in text and "INFO" not in text, text  # quiet off rank 0 ...
        assert "WARNING warning" not in text, text  # ... a warning every rank gives alike is rank 0's to show ...
        assert f"[rank {rank}/{world_size}] WARNING own warning from rank {rank}" in text  # ... but its own ...
        assert f"[rank {rank}/{world_size}] ERROR error from rank {rank}" in text  # ... and its errors are shown
    assert all(out["items"] == list(range(5)) for out in per_rank)  # the progress wrapper yields everything
