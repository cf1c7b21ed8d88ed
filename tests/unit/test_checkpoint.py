"""Checkpoints without a process group (a world of one): round trip, prefixes, atomicity, refusal of bad files,
the last K kept with last.pt naming the newest, the fallback from a corrupt one, --resume-from, a full disk."""

from __future__ import annotations

import builtins
import errno
import io
import os
import pickle
import random
import re

import numpy as np
import pytest
import torch
from torch import nn

from ddp_core.distributed import group as ddp_dist
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.exit_codes import STORAGE_EXIT_CODE
from ddp_core.lifecycle.states import load_model_state, strip_prefixes
from ddp_core.output.checkpoint import (
    FORMAT,
    CheckpointDir,
    CheckpointError,
    atomic_write,
    load_checkpoint,
    written_by,
)
from ddp_core.output.storage import StorageError
from ddp_core.training.seed import seed_everything
from experiments.toy import ToyModel
from tests.checkpointing import restore, save_checkpoint


def toy_states() -> dict:
    return {"model": ToyModel().state_dict()}


class CompiledLike(nn.Module):
    """Stands in for torch.compile's OptimizedModule: the real model under ``_orig_mod``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def ddp_like(inner: nn.Module) -> nn.parallel.DistributedDataParallel:
    """A DistributedDataParallel instance holding ``inner`` as ``.module``, without a process group.

    Real DDP cannot be built here; this object has DDP's type (which ``unwrap`` checks) and DDP's
    state-dict layout (every key prefixed with ``module.``), which is all checkpointing depends on.
    """
    wrapper = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper.module = inner
    return wrapper


def trained_model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A ToyModel and an Adam optimizer that has taken two steps, so its state is not empty."""
    seed_everything(seed)
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        loss = model(torch.randn(8, 10)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def assert_same_optimizer_state(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert_same_tensors(actual["state"][index], state)


def draws():
    """One draw from each generator a resume must restore."""
    return (
        torch.rand(5),
        torch.randn(3),
        np.random.rand(5),
        float(np.random.normal()),
        [random.random() for _ in range(5)],
        random.gauss(0, 1),
    )


def assert_same_draws(actual, expected) -> None:
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert np.array_equal(actual[2], expected[2])
    assert actual[3:] == expected[3:]


# ---- round trip ----


def test_save_and_load_round_trip(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    path = tmp_path / "checkpoints" / "last.pt"  # the parent directory does not exist yet
    save_checkpoint(path, model, optimizer, step=7, epoch=2)

    # loadable by plain torch.load with weights_only=True (the contract), and by load_checkpoint
    raw = torch.load(path, weights_only=True)
    checkpoint = load_checkpoint(path)
    for loaded in (raw, checkpoint):
        assert loaded["format"] == FORMAT
        assert (loaded["step"], loaded["position"]) == (7, {"step": 7, "epoch": 2, "epoch_samples": 0})
        assert loaded["world_size"] == ddp_dist.world_size() == 1 and loaded["experiment"] == "toy"
        assert (
            isinstance(loaded["rng"], list) and len(loaded["rng"]) == 1 and loaded["per_rank"] == ["rng", "comm_hook"]
        )
        assert_same_tensors(loaded["model"], model.state_dict())
        assert_same_optimizer_state(loaded["optimizer"], optimizer.state_dict())

    # restore into a fresh model and optimizer
    fresh_model = ToyModel()
    fresh_optimizer = torch.optim.Adam(fresh_model.parameters(), lr=0.01)
    assert restore(checkpoint, fresh_model, fresh_optimizer) == (7, 2)
    assert_same_tensors(fresh_model.state_dict(), model.state_dict())
    assert_same_optimizer_state(fresh_optimizer.state_dict(), optimizer.state_dict())

    # the next step is bitwise identical on the original and the restored pair
    batch = torch.randn(8, 10)
    for m, o in ((model, optimizer), (fresh_model, fresh_optimizer)):
        o.zero_grad()
        m(batch).pow(2).mean().backward()
        o.step()
    assert_same_tensors(fresh_model.state_dict(), model.state_dict())


def test_a_part_without_state_saves_none_and_the_file_knows_no_part(tmp_path):
    model = ToyModel()
    save_checkpoint(tmp_path / "last.pt", model, None, step=0, epoch=0)
    checkpoint = load_checkpoint(tmp_path / "last.pt")
    assert checkpoint["grad_scaler"] is None and checkpoint["comm_hook"] == [None]  # no scaler, no hook state
    assert "extra" not in checkpoint
    fresh = ToyModel()
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    assert restore(checkpoint, fresh, optimizer) == (0, 0)
    assert_same_tensors(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize(
    "wrap", [ddp_like, CompiledLike, lambda m: ddp_like(CompiledLike(m))], ids=["ddp", "compiled", "ddp+compiled"]
)
def test_saved_keys_have_no_wrapper_prefix(tmp_path, wrap):
    inner = ToyModel()
    wrapped = wrap(inner)
    assert all(key.startswith(("module.", "_orig_mod.")) for key in wrapped.state_dict())  # the wrapper adds them
    save_checkpoint(tmp_path / "last.pt", wrapped, None, step=1, epoch=0)
    saved = load_checkpoint(tmp_path / "last.pt")["model"]
    assert_same_tensors(saved, inner.state_dict())

    plain = ToyModel()
    plain.load_state_dict(saved)  # loads into a plain model with strict key matching
    assert_same_tensors(plain.state_dict(), inner.state_dict())


def test_round_trip_of_a_model_whose_submodule_is_named_module(tmp_path):
    """A plain model may have a child called ``module`` (an EMA or adapter wrapper, as in timm's ModelEmaV2).

    It is not a DDP wrapper: its keys must be saved and restored as they are.
    """

    class EmaStyle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = ToyModel()

    model = EmaStyle()
    save_checkpoint(tmp_path / "last.pt", model, None, step=1, epoch=0)
    checkpoint = load_checkpoint(tmp_path / "last.pt")
    fresh = EmaStyle()
    restore(checkpoint, fresh, None)
    assert_same_tensors(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_legacy_prefixed_state_dict_loads_into_a_plain_model(prefix):
    source = ToyModel()
    legacy = {prefix + key: value for key, value in source.state_dict().items()}
    assert strip_prefixes(legacy).keys() == source.state_dict().keys()
    assert_same_tensors(strip_prefixes(legacy), source.state_dict())

    target = ToyModel()
    load_model_state(target, legacy)
    assert_same_tensors(target.state_dict(), source.state_dict())


@pytest.mark.parametrize("wrap", [ddp_like, CompiledLike], ids=["ddp", "compiled"])
def test_plain_state_dict_loads_into_a_wrapped_model(wrap):
    source = ToyModel()
    inner = ToyModel()
    load_model_state(wrap(inner), source.state_dict())
    assert_same_tensors(inner.state_dict(), source.state_dict())


def test_strip_prefixes_leaves_other_keys_alone():
    state = {"net1.weight": 1, "modules.x": 2, "module_x.y": 3, "my.module.z": 4}
    assert strip_prefixes(state) == state


# ---- atomic writes ----


def test_atomic_write_keeps_the_previous_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "file.bin"
    atomic_write(path, lambda handle: handle.write(b"previous contents"))
    assert path.read_bytes() == b"previous contents"

    def killed_mid_write(handle):
        handle.write(b"half of the new")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        atomic_write(path, killed_mid_write)
    assert path.read_bytes() == b"previous contents"


def test_interrupted_checkpoint_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    model, optimizer = trained_model_and_optimizer(seed=1)
    save_checkpoint(path, model, optimizer, step=10, epoch=1)
    first = load_checkpoint(path)

    other, _ = trained_model_and_optimizer(seed=2)
    other_bytes = tmp_path / "other.pt"
    save_checkpoint(other_bytes, other, None, step=20, epoch=2)
    data = other_bytes.read_bytes()

    def killed(handle):
        handle.write(data[: len(data) // 2])
        raise KeyboardInterrupt  # what a Ctrl-C mid-save raises

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, killed)
    again = load_checkpoint(path)
    assert again["step"] == 10
    assert_same_tensors(again["model"], first["model"])


def test_leftover_temp_file_is_removed_by_the_next_save(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    leftover = directory / ".last.pt.tmp-123"
    leftover.write_bytes(b"\x00" * 100)  # from a save that was killed
    unrelated = directory / ".other.pt.tmp-5"
    unrelated.write_bytes(b"not ours")

    save_checkpoint(directory / "last.pt", ToyModel(), None, step=3, epoch=0)
    assert not leftover.exists()
    assert list(directory.glob(".last.pt.tmp-*")) == []
    assert unrelated.read_bytes() == b"not ours"  # only this file's temp files are cleaned up
    assert load_checkpoint(directory / "last.pt")["step"] == 3


def test_save_overwrites_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    for step in (1, 2, 3):
        save_checkpoint(path, ToyModel(), None, step=step, epoch=0)
        assert load_checkpoint(path)["step"] == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


# ---- files that must be refused ----


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path)  # a directory is not a checkpoint either


@pytest.mark.parametrize("cut", ["0", "1", "2", "3", "4", "64", "quarter", "half", "all-but-one"])
def test_truncated_checkpoint(tmp_path, cut):
    path = tmp_path / "last.pt"
    model, optimizer = trained_model_and_optimizer()
    save_checkpoint(path, model, optimizer, step=5, epoch=0)
    data = path.read_bytes()
    size = {"quarter": len(data) // 4, "half": len(data) // 2, "all-but-one": len(data) - 1}.get(cut) or int(cut)
    assert size < len(data)
    path.write_bytes(data[:size])  # what torch.save straight to the final path leaves when killed
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_garbage_file_is_corrupt(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


class MkdirPayload:
    """Unpickling this calls os.mkdir(marker): the classic code-execution payload."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class ExecPayload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # pickle.dump's default protocol, on purpose
@pytest.mark.parametrize("payload_cls", [MkdirPayload, ExecPayload])
@pytest.mark.parametrize("writer", ["torch.save", "torch.save-nested", "pickle.dump"])
def test_malicious_pickle_is_refused_without_running_code(tmp_path, payload_cls, writer):
    marker = tmp_path / "pwned"
    path = tmp_path / "last.pt"
    payload = payload_cls(str(marker))
    if writer == "torch.save":
        torch.save(payload, path)
    elif writer == "torch.save-nested":  # hidden inside a checkpoint that otherwise looks right
        torch.save({"format": FORMAT, "model": {"w": torch.zeros(2)}, "step": 1, "extra": {"x": payload}}, path)
    else:
        with open(path, "wb") as handle:
            pickle.dump(payload, handle)

    with pytest.raises(CheckpointError, match="weights-only"):
        load_checkpoint(path)
    assert not marker.exists(), "loading the checkpoint ran the payload"

    # control: the payload is live, so the refusal above is what kept it from running
    with open(path, "rb") as handle:
        if writer == "pickle.dump":
            pickle.load(handle)
        else:
            torch.load(handle, weights_only=False)
    assert marker.exists()


# ---- restore ----


def test_restore_refuses_a_different_world_size(tmp_path, capsys):
    path = tmp_path / "last.pt"
    saved_model = ToyModel()
    save_checkpoint(path, saved_model, None, step=4, epoch=0)
    checkpoint = load_checkpoint(path)
    checkpoint["world_size"] = 2

    target = ToyModel()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        restore(checkpoint, target, None)
    assert_same_tensors(target.state_dict(), before)  # nothing was loaded

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        exits_with_one_line(restore)(checkpoint, target, None)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "WORLD_SIZE=2" in lines[0]


def test_the_world_size_of_a_checkpoint_is_read_without_restoring_it(tmp_path):
    """What start_run checks before manifest.json records a resume that restore would refuse."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, ToyModel(), None, step=4, epoch=0)
    assert written_by(path).world_size == 1
    checkpoint = load_checkpoint(path)
    checkpoint["world_size"] = 3
    torch.save(checkpoint, path)
    assert written_by(path).world_size == 3
    path.write_bytes(path.read_bytes()[:100])  # truncated: the resume's fallback reports it, not this peek
    assert written_by(path) is None
    assert written_by(tmp_path / "missing.pt") is None


def test_restore_refuses_a_foreign_format(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, ToyModel(), None, step=4, epoch=0)
    checkpoint = load_checkpoint(path)
    checkpoint["format"] = "someone-else/3"
    with pytest.raises(CheckpointError, match="not a ddp-lab checkpoint"):
        restore(checkpoint, ToyModel(), None)
    with pytest.raises(CheckpointError, match="not a ddp-lab checkpoint"):
        restore({"model": {}}, ToyModel(), None)


@pytest.mark.parametrize("earlier", ["ddp-lab/1", "ddp-lab/2"])
def test_a_checkpoint_of_an_earlier_format_is_refused_in_one_line_not_guessed(tmp_path, earlier):
    """Format 1 did not store how far into its epoch the run was, format 2 held its parts at fixed keys: nothing
    guesses either now."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, ToyModel(), None, step=4, epoch=0)
    checkpoint = load_checkpoint(path)
    assert checkpoint["format"] == FORMAT == "ddp-lab/3"
    checkpoint["format"] = earlier
    with pytest.raises(CheckpointError) as refused:
        restore(checkpoint, ToyModel(), None)
    assert f"earlier ddp-lab (format {earlier}" in str(refused.value) and "\n" not in str(refused.value)


def test_restore_resumes_every_random_stream(tmp_path):
    path = tmp_path / "last.pt"
    model = ToyModel()
    seed_everything(123)
    draws()  # move every generator (and the gauss caches) away from a fresh seed
    np.random.normal()  # leaves a cached gaussian in numpy's legacy generator
    random.gauss(0, 1)
    save_checkpoint(path, model, None, step=9, epoch=1)
    expected = draws()  # what the run would have drawn next

    draws()
    seed_everything(999)  # anything at all happens before the resume
    draws()

    assert restore(load_checkpoint(path), ToyModel(), None) == (9, 1)
    assert_same_draws(draws(), expected)


# ---- several checkpoints: CheckpointDir ----


def save_steps(directory, steps, keep=2) -> CheckpointDir:
    checkpoints = CheckpointDir(directory, keep=keep)
    for step in steps:
        checkpoints.save(step, toy_states)
    return checkpoints


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def cut_in_half(path) -> None:
    """In place, as a disk error or a bad copy would: a hard link to it (last.pt) is cut too."""
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def test_the_last_k_are_kept_named_by_step_and_last_pt_names_the_newest(tmp_path):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [5, 10, 1234])
    assert names(directory) == ["last.pt", "step_00000010.pt", "step_00001234.pt"]
    assert checkpoints.last.samefile(directory / "step_00001234.pt")  # a hard link: no second copy on disk
    assert torch.load(checkpoints.last, weights_only=True)["step"] == 1234  # the contract: weights-only loadable
    assert checkpoints.complete() == [(1234, directory / "step_00001234.pt"), (10, directory / "step_00000010.pt")]
    assert checkpoints.intact() == f"the last checkpoint, step 1234, is intact: {directory / 'step_00001234.pt'}"


@pytest.mark.parametrize(("keep", "kept"), [(1, [30]), (3, [10, 20, 30]), (0, [0, 10, 20, 30])])
def test_keep_checkpoints(tmp_path, keep, kept):
    directory = tmp_path / "checkpoints"
    save_steps(directory, [0, 10, 20, 30], keep=keep)
    assert names(directory) == ["last.pt", *(f"step_{step:08d}.pt" for step in kept)]


def test_a_save_that_fails_mid_write_deletes_nothing_and_leaves_no_temp_file(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20])
    real_save = torch.save

    def half_then_interrupted(obj, handle, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        handle.write(buffer.getvalue()[: buffer.tell() // 2])
        raise KeyboardInterrupt  # a Ctrl-C mid-save

    monkeypatch.setattr(torch, "save", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(30, toy_states)
    assert names(directory) == ["last.pt", "step_00000010.pt", "step_00000020.pt"]  # step 10 not deleted either
    assert load_checkpoint(checkpoints.last)["step"] == 20


def test_a_kill_between_the_complete_file_and_last_pt_resumes_from_the_new_file(tmp_path, monkeypatch, caplog):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20])

    def killed(self, path):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointDir, "_point_last_at", killed)
        with pytest.raises(KeyboardInterrupt):
            checkpoints.save(30, toy_states)
    assert names(directory) == [
        "last.pt",
        "step_00000010.pt",
        "step_00000020.pt",
        "step_00000030.pt",
    ]  # nothing deleted yet
    assert load_checkpoint(checkpoints.last)["step"] == 20

    with caplog.at_level("WARNING"):
        checkpoint, path = checkpoints.load_for_resume()
    assert (checkpoint["step"], path) == (30, directory / "step_00000030.pt")  # the newest complete one
    assert checkpoints.last.samefile(path) and not caplog.records  # last.pt repaired, nothing to warn about


def test_a_kill_while_last_pt_is_replaced_leaves_the_previous_last_pt(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10])
    real_replace = os.replace

    def replace(source, target, *args, **kwargs):
        if str(target).endswith("last.pt"):
            raise KeyboardInterrupt
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(20, toy_states)
    assert names(directory) == ["last.pt", "step_00000010.pt", "step_00000020.pt"]  # no temp link left
    assert load_checkpoint(checkpoints.last)["step"] == 10


def test_the_temp_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10])
    for name in (".step_00000020.pt.tmp-123", ".last.pt.tmp-123"):
        (directory / name).write_bytes(b"\x00" * 100)
    checkpoints.save(30, toy_states)
    assert names(directory) == ["last.pt", "step_00000010.pt", "step_00000030.pt"]


def test_last_pt_is_a_copy_where_the_filesystem_has_no_hard_links(tmp_path, monkeypatch):
    def no_links(source, target, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20, 30])
    assert names(directory) == ["last.pt", "step_00000020.pt", "step_00000030.pt"]
    assert not checkpoints.last.samefile(directory / "step_00000030.pt")
    assert checkpoints.last.read_bytes() == (directory / "step_00000030.pt").read_bytes()
    checkpoint, _ = checkpoints.load_for_resume()
    assert checkpoint["step"] == 30


def test_resume_falls_back_from_a_corrupt_newest_checkpoint_with_one_warning_naming_both(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20])
    cut_in_half(directory / "step_00000020.pt")
    with caplog.at_level("WARNING"):
        checkpoint, path = checkpoints.load_for_resume()
    assert (checkpoint["step"], path) == (10, directory / "step_00000010.pt")
    [warning] = [record.getMessage() for record in caplog.records]
    assert str(directory / "step_00000020.pt") in warning and "truncated or corrupt" in warning
    assert str(directory / "step_00000010.pt") in warning and "(step 10)" in warning and "\n" not in warning
    # the bad file is kept aside (never picked again, never rotated over a good one); last.pt names step 10
    assert names(directory) == ["last.pt", "step_00000010.pt", "step_00000020.pt.corrupt"]
    assert checkpoints.last.samefile(directory / "step_00000010.pt")


def test_a_corrupt_last_pt_that_is_no_link_falls_back_to_the_step_files(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20])
    checkpoints.last.unlink()
    checkpoints.last.write_bytes(b"PK\x03\x04 not a checkpoint")  # replaced by something else entirely
    with caplog.at_level("WARNING"):
        checkpoint, path = checkpoints.load_for_resume()
    assert checkpoint["step"] == 20 and path == directory / "step_00000020.pt"
    [warning] = [record.getMessage() for record in caplog.records]
    assert str(checkpoints.last) in warning and str(path) in warning
    assert names(directory) == ["last.pt", "last.pt.corrupt", "step_00000010.pt", "step_00000020.pt"]
    assert checkpoints.last.samefile(path)


def test_a_run_from_before_step_files_resumes_from_its_last_pt(tmp_path):
    directory = tmp_path / "checkpoints"
    save_checkpoint(directory / "last.pt", ToyModel(), None, step=7, epoch=0)
    checkpoint, path = CheckpointDir(directory).load_for_resume()
    assert (checkpoint["step"], path) == (7, directory / "last.pt")


def test_no_usable_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    directory = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        CheckpointDir(directory).load_for_resume()
    checkpoints = save_steps(directory, [10])
    cut_in_half(directory / "step_00000010.pt")
    with pytest.raises(SystemExit) as info:
        exits_with_one_line(checkpoints.load_for_resume)()
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --resume: no checkpoint in") and "step_00000010.pt is truncated or corrupt" in line
    assert (directory / "step_00000010.pt").is_file()  # nothing renamed when nothing was resumed


def test_resume_from_loads_exactly_that_file_and_sets_the_later_ones_aside(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20, 30], keep=0)
    with caplog.at_level("WARNING"):
        checkpoint, path = checkpoints.load_for_resume(directory / "step_00000010.pt")
    assert (checkpoint["step"], path) == (10, directory / "step_00000010.pt")
    assert names(directory) == [
        "last.pt",
        "step_00000010.pt",
        "step_00000020.pt.superseded",
        "step_00000030.pt.superseded",
    ]
    assert checkpoints.last.samefile(path)
    [line] = [record.getMessage() for record in caplog.records]
    assert "step_00000020.pt.superseded" in line and "step_00000030.pt.superseded" in line
    checkpoints.keep = 2
    checkpoints.save(20, toy_states)  # the new step 20 is the newest: nothing good is rotated away
    assert names(directory)[:3] == ["last.pt", "step_00000010.pt", "step_00000020.pt"]


def test_resume_from_a_file_of_another_run(tmp_path):
    other = save_steps(tmp_path / "other" / "checkpoints", [5])
    directory = tmp_path / "run" / "checkpoints"
    checkpoints = save_steps(directory, [10])
    checkpoint, path = checkpoints.load_for_resume(other.last)
    assert (checkpoint["step"], path) == (5, other.last)
    assert names(directory) == ["step_00000010.pt.superseded"]  # last.pt named it: gone until the next save


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest's captured stderr
@pytest.mark.parametrize("damage", ["missing", "corrupt", "directory"])
def test_resume_from_a_missing_or_corrupt_file_exits_2_before_anything_starts(tmp_path, capsys, damage):
    from experiments.toy import main

    path = tmp_path / "checkpoints" / "step_00000010.pt"
    if damage == "corrupt":
        save_steps(path.parent, [10])
        cut_in_half(path)
    elif damage == "directory":
        path.mkdir(parents=True)
    with pytest.raises(SystemExit) as info:
        main(["--resume-from", str(path), "--run-dir", str(tmp_path / "run")])
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --resume-from={path}: ")
    assert ("truncated or corrupt" if damage == "corrupt" else "no checkpoint at") in line
    assert not (tmp_path / "run").exists()


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
@pytest.mark.parametrize("value", ["-1", "x", ""])
def test_keep_checkpoints_refuses_what_it_cannot_use(tmp_path, capsys, value):
    from experiments.toy import main

    with pytest.raises(SystemExit) as info:
        main(["--keep-checkpoints", value, "--run-dir", str(tmp_path / "run")])
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--keep-checkpoints" in line and not (tmp_path / "run").exists()


# ---- a full disk, an unwritable folder ----


class FullDisk(io.FileIO):
    """A file on a full disk: it can be created, but no byte can be written."""

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def failing_open(error_number: int):
    def fake_open(file, mode="r", *args, **kwargs):
        if "w" not in mode:
            return builtins.open(file, mode, *args, **kwargs)
        if error_number == errno.ENOSPC:
            return io.BufferedWriter(FullDisk(file, "w"))
        raise OSError(error_number, os.strerror(error_number), str(file))

    return fake_open


@pytest.mark.parametrize(
    ("error_number", "name"), [(errno.ENOSPC, "ENOSPC"), (errno.EACCES, "EACCES"), (errno.EROFS, "EROFS")]
)
def test_a_failed_write_is_one_line_naming_the_path_the_error_and_the_intact_checkpoint(
    tmp_path, monkeypatch, error_number, name
):
    directory = tmp_path / "checkpoints"
    checkpoints = save_steps(directory, [10, 20])
    monkeypatch.setattr(
        "ddp_core.output.checkpoint.open", failing_open(error_number), raising=False
    )  # what atomic_write opens
    with pytest.raises(StorageError) as raised:
        checkpoints.save(30, toy_states)
    message = str(raised.value)
    assert message.startswith(f"cannot write {directory / 'step_00000030.pt'}: {os.strerror(error_number)} ({name}")
    assert f"the last checkpoint, step 20, is intact: {directory / 'step_00000020.pt'}" in message
    assert message.endswith("then continue with --resume") and "\n" not in message
    if error_number == errno.ENOSPC:
        assert re.search(r"\(ENOSPC; it needs about [\d.]+ kB; [\d.]+ [kMGT]?B free\)", message), (
            message
        )  # a toy: a few kB
    assert raised.value.exit_code == STORAGE_EXIT_CODE == 74
    assert names(directory) == ["last.pt", "step_00000010.pt", "step_00000020.pt"]  # no temp file, nothing deleted
    assert load_checkpoint(checkpoints.last)["step"] == 20
