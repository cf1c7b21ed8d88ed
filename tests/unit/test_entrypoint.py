"""The container entrypoint: environment -> torchrun command (ddp_core/entrypoint.py)."""

from __future__ import annotations

import sys

import pytest

from ddp_core.entrypoint import main, torchrun_command
from ddp_core.errors import ConfigError

TORCHRUN = [sys.executable, "-m", "ddp_core.torchrun"]


def test_defaults_run_the_toy_on_one_node_with_extra_flags_passed_through(monkeypatch):
    monkeypatch.setattr("ddp_core.entrypoint.default_nproc", lambda: 3)
    command = torchrun_command({}, ["--steps", "5"])
    assert command == TORCHRUN + ["--nproc-per-node=3", "--max-restarts=0", "--standalone", "-m", "experiments.toy", "--steps", "5"]


def test_static_rendezvous_for_several_nodes():
    env = {"EXPERIMENT": "cifar10", "NPROC_PER_NODE": "8", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "MAX_RESTARTS": "2"}
    assert torchrun_command(env, []) == TORCHRUN + [
        "--nproc-per-node=8", "--max-restarts=2", "--nnodes=2", "--node-rank=1", "--master-addr=127.0.0.1", "--master-port=29400",
        "--rdzv-conf=timeout=300", "-m", "experiments.cifar10",
    ]


def test_c10d_rendezvous_for_several_nodes():
    env = {"NPROC_PER_NODE": "1", "NNODES": "3", "MASTER_ADDR": "localhost", "RDZV_BACKEND": "c10d", "RDZV_ID": "job7", "DIST_TIMEOUT_S": "60"}
    assert torchrun_command(env, []) == TORCHRUN + [
        "--nproc-per-node=1", "--max-restarts=0", "--nnodes=3", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29500", "--rdzv-id=job7",
        "--rdzv-conf=join_timeout=60", "-m", "experiments.toy",
    ]


BAD = [
    ({"EXPERIMENT": "mnist"}, "EXPERIMENT='mnist' is not a module in experiments/"),
    ({"EXPERIMENT": "../toy"}, "EXPERIMENT='../toy' is not a module"),
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 is out of range"),
    ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE='two' is not an integer"),
    ({"NNODES": "2", "NPROC_PER_NODE": "1"}, "NNODES=2 needs MASTER_ADDR"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "1"}, "NODE_RANK=2 must be < NNODES=2"),
    ({"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000", "NPROC_PER_NODE": "1"}, "MASTER_PORT=70000 is out of range"),
    ({"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid", "NPROC_PER_NODE": "1"}, "MASTER_ADDR='no-such-host.invalid' does not resolve"),
    ({"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "RDZV_BACKEND": "etcd", "NPROC_PER_NODE": "1"}, "RDZV_BACKEND='etcd' is not supported"),
    ({"MAX_RESTARTS": "-1", "NPROC_PER_NODE": "1"}, "MAX_RESTARTS=-1 is out of range"),
    ({"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "DIST_TIMEOUT_S": "0", "NPROC_PER_NODE": "1"}, "DIST_TIMEOUT_S=0 is out of range"),
]


@pytest.mark.parametrize("env,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_values_exit_2_with_one_line(monkeypatch, capsys, env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        torchrun_command(env, [])
    for name in ("EXPERIMENT", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_BACKEND", "RDZV_ID", "MAX_RESTARTS", "DIST_TIMEOUT_S"):
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
    assert calls == [(sys.executable, TORCHRUN + ["--nproc-per-node=2", "--max-restarts=0", "--standalone", "-m", "experiments.toy", "--steps", "3"])]
    assert capsys.readouterr().out.startswith("+ ")  # the command is shown before it runs
