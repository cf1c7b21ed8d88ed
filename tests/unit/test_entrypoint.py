"""The container entrypoint: environment -> torchrun command (ddp_core/entrypoint.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from ddp_core.distributed import cuda as ddp_cuda
from ddp_core.distributed.cuda import Driver
from ddp_core.entrypoint import main, torchrun_command
from ddp_core.errors import ConfigError

TORCHRUN = [sys.executable, "-m", "ddp_core.torchrun"]


def test_defaults_run_the_toy_on_one_node_with_extra_flags_passed_through(monkeypatch):
    monkeypatch.setattr("ddp_core.entrypoint.default_nproc", lambda backend: 3)
    command = torchrun_command({}, ["--steps", "5"])
    assert command == TORCHRUN + [
        "--nproc-per-node=3",
        "--max-restarts=0",
        "--standalone",
        "-m",
        "experiments.toy",
        "--steps",
        "5",
    ]


def test_static_rendezvous_for_several_nodes():
    env = {
        "EXPERIMENT": "cifar10",
        "NPROC_PER_NODE": "8",
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "MAX_RESTARTS": "2",
    }
    assert torchrun_command(env, []) == TORCHRUN + [
        "--nproc-per-node=8",
        "--max-restarts=2",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=127.0.0.1",
        "--master-port=29400",
        "--rdzv-conf=timeout=600",
        "-m",
        "experiments.cifar10",
    ]


def test_c10d_rendezvous_for_several_nodes():
    env = {
        "NPROC_PER_NODE": "1",
        "NNODES": "3",
        "MASTER_ADDR": "localhost",
        "RDZV_BACKEND": "c10d",
        "RDZV_ID": "job7",
        "DIST_INIT_TIMEOUT_S": "60",
    }
    assert torchrun_command(env, []) == TORCHRUN + [
        "--nproc-per-node=1",
        "--max-restarts=0",
        "--nnodes=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:29500",
        "--rdzv-id=job7",
        "--rdzv-conf=join_timeout=60",
        "-m",
        "experiments.toy",
    ]


BAD = [
    (
        {"EXPERIMENT": "mnist"},
        "EXPERIMENT='mnist' is not a module in experiments/: use one of charlm, cifar10, collectives, commbench, "
        "preflight, toy",
    ),
    ({"EXPERIMENT": "../toy"}, "EXPERIMENT='../toy' is not a module"),
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 is out of range"),
    ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE='two' is not an integer"),
    ({"NNODES": "2", "NPROC_PER_NODE": "1"}, "NNODES=2 needs MASTER_ADDR"),
    (
        {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "1"},
        "NODE_RANK=2 must be < NNODES=2",
    ),
    (
        {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000", "NPROC_PER_NODE": "1"},
        "MASTER_PORT=70000 is out of range",
    ),
    (
        {"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid", "NPROC_PER_NODE": "1"},
        "MASTER_ADDR='no-such-host.invalid' does not resolve",
    ),
    (
        {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "RDZV_BACKEND": "etcd", "NPROC_PER_NODE": "1"},
        "RDZV_BACKEND='etcd' is not supported",
    ),
    ({"MAX_RESTARTS": "-1", "NPROC_PER_NODE": "1"}, "MAX_RESTARTS=-1 is out of range"),
    (
        {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "DIST_TIMEOUT_S": "0", "NPROC_PER_NODE": "1"},
        "DIST_TIMEOUT_S=0 is out of range",
    ),
    (
        {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "DIST_INIT_TIMEOUT_S": "0", "NPROC_PER_NODE": "1"},
        "DIST_INIT_TIMEOUT_S=0 is out of range",
    ),
]


@pytest.mark.parametrize("env,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_values_exit_2_with_one_line(monkeypatch, capsys, env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        torchrun_command(env, [])
    for name in (
        "EXPERIMENT",
        "NPROC_PER_NODE",
        "NNODES",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RDZV_BACKEND",
        "RDZV_ID",
        "MAX_RESTARTS",
        "DIST_TIMEOUT_S",
        "DIST_INIT_TIMEOUT_S",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("os.execv", lambda *a: pytest.fail("must not exec on bad input"))
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_main_execs_torchrun(monkeypatch, capsys):
    for name in ("EXPERIMENT", "NNODES", "MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    calls = []
    monkeypatch.setattr("os.execv", lambda path, argv: calls.append((path, argv)))
    main(["--steps", "3"])
    assert calls == [
        (
            sys.executable,
            TORCHRUN
            + ["--nproc-per-node=2", "--max-restarts=0", "--standalone", "-m", "experiments.toy", "--steps", "3"],
        )
    ]
    assert capsys.readouterr().out.startswith("+ ")  # the command is shown before it runs


OLD_DRIVER = Driver(version="470.82.01", cuda="11.4", gpus=4)


# (driver NVML sees, GPUs torch can use, their compute capability, BACKEND) -> --nproc-per-node, or the error
NPROC_CASES = [
    (None, 0, None, "", 2),  # a CPU machine: 2 gloo processes, as before
    (
        OLD_DRIVER,
        0,
        None,
        "",
        r"driver 470\.82\.01 sees 4 GPU\(s\).*built for CUDA 13\.0.*BACKEND=gloo",
    ),  # not 2 CPU processes
    (OLD_DRIVER, 0, None, "nccl", r"driver 470\.82\.01"),
    (OLD_DRIVER, 0, None, "gloo", 2),  # CPU on purpose
    (OLD_DRIVER, 4, (9, 0), "", 4),
    (OLD_DRIVER, 4, (6, 1), "", r"GPU 0 \(a GPU\) has compute capability 6\.1"),
    (OLD_DRIVER, 4, (6, 1), "gloo", 4),  # gloo on a GPU machine: one process per GPU as before, on CPU
]


@pytest.mark.parametrize(("driver", "usable", "capability", "backend", "expected"), NPROC_CASES)
def test_the_default_process_count_never_hides_an_unusable_gpu(
    monkeypatch, driver, usable, capability, backend, expected
):
    monkeypatch.setattr(ddp_cuda, "nvml_driver", lambda: driver)
    monkeypatch.setattr(ddp_cuda, "proc_driver_version", lambda: None)
    monkeypatch.delenv(
        "CUDA_VISIBLE_DEVICES", raising=False
    )  # tests/conftest.py hid the GPUs; here the driver sees them
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: usable > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: usable)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"])
    monkeypatch.setattr(ddp_cuda, "device_capability", lambda index: capability)
    monkeypatch.setattr(ddp_cuda, "device_name", lambda index: "a GPU")
    environ = {"BACKEND": backend} if backend else {}
    if isinstance(expected, int):
        assert torchrun_command(environ, [])[3] == f"--nproc-per-node={expected}"
    else:
        with pytest.raises(ConfigError, match=expected):
            torchrun_command(environ, [])
