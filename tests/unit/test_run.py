"""Run-directory decisions that need no process group."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ddp_core.distributed import cuda as ddp_cuda
from ddp_core.distributed.cuda import Driver
from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.group import DistContext
from ddp_core.distributed.network import NetworkChoice
from ddp_core.errors import ConfigError
from ddp_core.output import run as ddp_run
from ddp_core.output.checkpoint import CheckpointDir
from ddp_core.output.run import _gpu_names, _refuse_what_rank0_cannot_continue, start_run
from experiments.toy import ToyArgs


def _refuse_a_checkpoint_on_another_host(seen: list[tuple[str, str | None]]) -> None:
    """Each rank's host and checkpoint, as start_run gathers them (device, network: none; options: not a resume)."""
    _refuse_what_rank0_cannot_continue([(*row, "cpu", None, None) for row in seen], ToyArgs(), continuing=True)


def test_a_checkpoint_only_on_another_host_is_refused_naming_both():
    seen = [("node-b", None), ("node-a", "runs/toy/x/checkpoints/last.pt")]  # c10d made node-b rank 0
    with pytest.raises(
        ConfigError,
        match=r"rank 0 \(host node-b\) has no checkpoint .* rank 1 \(host node-a\) has runs/toy/x/checkpoints/last\.pt",
    ):
        _refuse_a_checkpoint_on_another_host(seen)


def test_a_resume_whose_ranks_rebuilt_other_options_is_refused_naming_the_rank_host_and_option():
    """A node without the run directory (no shared storage) rebuilt its options from its command line."""
    rank0, node1 = ToyArgs(lr=0.5, steps=120), dataclasses.asdict(ToyArgs())
    row = ("node-a", "runs/toy/x/checkpoints/last.pt", "cpu", None)
    agreed = [(*row, dataclasses.asdict(rank0)), (*row, dataclasses.asdict(rank0))]
    _refuse_what_rank0_cannot_continue(agreed, rank0, continuing=True)
    with pytest.raises(
        ConfigError, match=r"rank 1 \(host node-b\) .*--steps: 200 -> 120, --lr: 0\.2 -> 0\.5 \(rank 1 -> rank 0\)"
    ):
        _refuse_what_rank0_cannot_continue([agreed[0], ("node-b", None, "cpu", None, node1)], rank0, continuing=True)


@pytest.mark.parametrize(
    "seen",
    [
        [("node-a", None), ("node-b", None)],  # nobody has one: the usual rules apply
        [("node-a", None), ("node-a", "runs/toy/x/checkpoints/last.pt")],  # same host: rank 0 would see it too
    ],
)
def test_no_refusal_without_a_checkpoint_elsewhere(seen):
    _refuse_a_checkpoint_on_another_host(seen)


@pytest.mark.parametrize(
    ("device", "deterministic", "warned"), [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)]
)
def test_a_cuda_resume_without_deterministic_says_it_will_not_be_bitwise(
    tmp_path, caplog, monkeypatch, device, deterministic, warned
):
    """No GPU is touched: the decision reads only the device's type (a torch.device needs no CUDA)."""
    monkeypatch.setattr(ddp_cuda, "device_name", lambda index: "a GPU")  # for the manifest's device list
    run_dir = tmp_path / "run"
    CheckpointDir.of_run(run_dir).dir.mkdir(parents=True)
    CheckpointDir.of_run(run_dir).last.write_bytes(b"a checkpoint")
    args = ToyArgs(run_dir=str(run_dir), deterministic=deterministic)
    ctx = DistContext(
        env=DistEnv(),
        backend="nccl" if device == "cuda" else "gloo",
        device=torch.device(device, 0) if device == "cuda" else torch.device(device),
    )
    with caplog.at_level("WARNING"):
        run = start_run("toy", args, ctx, resume=True)
    assert run.resume
    lines = [r.getMessage() for r in caplog.records if "--deterministic" in r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines


def pretend_h100s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(ddp_cuda, "device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(ddp_cuda, "nvml_driver", lambda: Driver(version="580.65.06", cuda="13.0", gpus=8))


def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ddp_cuda, "nvml_driver", lambda: None)
    monkeypatch.setattr(ddp_cuda, "proc_driver_version", lambda: None)


# (machine, this rank's device) -> the manifest's GPU fields
MACHINES = [
    (no_driver, torch.device("cpu"), {"devices": ["cpu"], "gpus": []}, {"driver": None, "cudnn": None, "nccl": None}),
    (
        pretend_h100s,
        torch.device("cuda", 0),
        {"devices": ["cuda:0 NVIDIA H100 80GB HBM3"], "gpus": ["NVIDIA H100 80GB HBM3"]},
        {"driver": "580.65.06", "cudnn": "9.10.2", "nccl": "2.27.3"},
    ),
]


@pytest.mark.parametrize(("machine", "device", "fields", "versions"), MACHINES, ids=["cpu", "h100"])
def test_the_manifest_records_the_gpus_driver_and_libraries(tmp_path, monkeypatch, machine, device, fields, versions):
    machine(monkeypatch)
    ctx = DistContext(env=DistEnv(), backend="nccl" if device.type == "cuda" else "gloo", device=device)
    run = start_run("toy", ToyArgs(run_dir=str(tmp_path / "run")), ctx)
    manifest = json.loads((run.dir / "manifest.json").read_text())
    assert {key: manifest[key] for key in fields} == fields
    assert {key: manifest["versions"][key] for key in versions} == versions
    assert manifest["versions"]["cuda"] == torch.version.cuda  # the CUDA torch was built for, CPU or not


def test_every_ranks_device_and_network_come_with_the_hosts_in_one_collective(tmp_path, monkeypatch):
    """start_run already gathers each rank's host: the device and the network ride along, no second collective."""
    no_driver(monkeypatch)
    sent = []
    eth1 = NetworkChoice("NCCL_SOCKET_IFNAME", "eth1", "eth1", "10.0.0.2", "NCCL_SOCKET_IFNAME, yours", True).as_dict()

    def gather(obj):
        sent.append(obj)
        return [
            obj,
            ("node-b", None, "cuda:0 NVIDIA H100 80GB HBM3", eth1, None),  # options: only a resume's
            ("node-b", None, "cuda:1 NVIDIA A100-SXM4-80GB", eth1, None),
        ]

    monkeypatch.setattr(ddp_run, "all_gather_object", gather)
    chosen = NetworkChoice(
        "GLOO_SOCKET_IFNAME", "eth0", "eth0", "10.0.0.1", "the route to MASTER_ADDR 10.0.0.1; ...", False
    )
    ctx = DistContext(env=DistEnv(), backend="gloo", device=torch.device("cpu"), network=chosen)
    run = start_run("toy", ToyArgs(run_dir=str(tmp_path / "run")), ctx)
    manifest = json.loads((run.dir / "manifest.json").read_text())
    assert len(sent) == 1 and sent[0][2] == "cpu" and sent[0][3] == chosen.as_dict()
    assert manifest["network"] == [chosen.as_dict(), eth1, eth1]
    assert manifest["devices"] == ["cpu", "cuda:0 NVIDIA H100 80GB HBM3", "cuda:1 NVIDIA A100-SXM4-80GB"]
    assert manifest["gpus"] == ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"]
    assert len(manifest["hosts"]) == 2 and "node-b" in manifest["hosts"]


@pytest.mark.parametrize(
    ("devices", "names"),
    [
        (["cpu", "cpu"], []),
        (["cuda:0 NVIDIA H100 80GB HBM3", "cuda:1 NVIDIA H100 80GB HBM3"], ["NVIDIA H100 80GB HBM3"]),
        (["cuda:0 B", "cuda:0 A", "cpu"], ["A", "B"]),
        (["cuda:3"], []),  # no name known
    ],
)
def test_gpu_names_are_the_distinct_models(devices, names):
    assert _gpu_names(devices) == names
