"""Bad launch configuration: a ConfigError naming the variable and the fix, exit code 2, one line.

Covers DistEnv.from_environ (torchrun's variables) and ddp_core.distributed.group.validate (backend, timeout,
init method, MASTER_ADDR resolution), which both run before any process group exists.
"""

from __future__ import annotations

import re

import pytest
import torch

from ddp_core.distributed import cuda as ddp_cuda
from ddp_core.distributed import group as ddp_dist
from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.group import BACKENDS, DEFAULT_TIMEOUT_S, DistConfig, validate
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE

UNRESOLVABLE = "no-such-host.invalid"  # RFC 6761: .invalid never resolves


def names(message: str, variable: str) -> bool:
    """``variable`` appears as a whole name: RANK=2 must not be found inside LOCAL_RANK=2."""
    return re.search(rf"(?<![A-Za-z_]){re.escape(variable)}", message) is not None


TWO_RANKS = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def expect_exit_2(capsys, fn, *args, variable: str, fix: str) -> str:
    """``fn(*args)`` wrapped like an entry point: exit code 2 and ONE line on stderr naming ``variable``."""
    capsys.readouterr()  # drop anything printed before
    with pytest.raises(SystemExit) as info:
        exits_with_one_line(fn)(*args)
    assert info.value.code == CONFIG_ERROR_EXIT_CODE == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {captured.err!r}"
    assert captured.err.endswith("\n")
    assert lines[0].startswith("error: ")
    assert names(lines[0], variable), f"{variable!r} not named in {lines[0]!r}"
    assert fix in lines[0]
    return lines[0]


# (environment, variable the message must name, text of the fix the message must contain)
BAD_ENVIRONMENTS = [
    pytest.param({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc'", "torchrun", id="RANK-not-int"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "x"}, "WORLD_SIZE='x'", "torchrun", id="WORLD_SIZE-not-int"),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "first"},
        "LOCAL_RANK='first'",
        "torchrun",
        id="LOCAL_RANK-not-int",
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2.5"},
        "LOCAL_WORLD_SIZE='2.5'",
        "torchrun",
        id="LOCAL_WORLD_SIZE-not-int",
    ),
    pytest.param({**TWO_RANKS, "MASTER_PORT": "http"}, "MASTER_PORT='http'", "torchrun", id="MASTER_PORT-not-int"),
    pytest.param({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1", "0..2**31-1", id="RANK-negative"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0", "1..2**31-1", id="WORLD_SIZE-zero"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "-3"}, "WORLD_SIZE=-3", "1..2**31-1", id="WORLD_SIZE-negative"),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1", "0..2**31-1", id="LOCAL_RANK-negative"
    ),
    pytest.param({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2", "0 to 1", id="RANK-equals-WORLD_SIZE"),
    pytest.param({"RANK": "7", "WORLD_SIZE": "4"}, "RANK=7", "0 to 3", id="RANK-above-WORLD_SIZE"),
    pytest.param(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
        "LOCAL_RANK=2",
        "0 to 1",
        id="LOCAL_RANK-equals-LOCAL_WORLD_SIZE",
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
        "LOCAL_WORLD_SIZE=3",
        "WORLD_SIZE=2",
        id="LOCAL_WORLD_SIZE-above-WORLD_SIZE",
    ),
    pytest.param(
        {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
        "LOCAL_RANK",
        "0..1",
        id="LOCAL_RANK-missing-multinode",
    ),
    pytest.param({**TWO_RANKS, "MASTER_PORT": "0"}, "MASTER_PORT=0", "1..65535", id="MASTER_PORT-zero"),
    pytest.param({**TWO_RANKS, "MASTER_PORT": "70000"}, "MASTER_PORT=70000", "1..65535", id="MASTER_PORT-70000"),
    pytest.param({"RANK": "0"}, "WORLD_SIZE", "set WORLD_SIZE", id="RANK-without-WORLD_SIZE"),
    pytest.param({"WORLD_SIZE": "2"}, "RANK", "set RANK", id="WORLD_SIZE-without-RANK"),
]


@pytest.mark.parametrize("environ, variable, fix", BAD_ENVIRONMENTS)
def test_bad_environment_raises_config_error(environ, variable, fix):
    with pytest.raises(ConfigError) as info:
        DistEnv.from_environ(environ)
    message = str(info.value)
    assert names(message, variable), f"{variable!r} not named in {message!r}"
    assert fix in message
    assert "\n" not in message


@pytest.mark.parametrize("environ, variable, fix", BAD_ENVIRONMENTS)
def test_bad_environment_exits_2_with_one_line(capsys, environ, variable, fix):
    expect_exit_2(capsys, DistEnv.from_environ, environ, variable=variable, fix=fix)


def test_bad_os_environ_is_read_when_no_mapping_given(clean_env, capsys):
    clean_env.setenv("RANK", "abc")
    clean_env.setenv("WORLD_SIZE", "2")
    expect_exit_2(capsys, DistEnv.from_environ, variable="RANK='abc'", fix="torchrun")


def test_no_variables_is_a_world_of_one(clean_env):
    for env in (DistEnv.from_environ({}), DistEnv.from_environ()):
        assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
        assert env.master_addr is None and env.master_port is None
        assert env.rank == 0 and not env.is_distributed
        assert env.num_nodes == 1
        assert env.restart_count == 0 and not env.agent_store
        # A world of one needs no MASTER_ADDR/PORT and no CUDA.
        assert validate(DistConfig(), env) == ("gloo", torch.device("cpu"))


def test_blank_variables_count_as_unset():
    assert DistEnv.from_environ({"RANK": " ", "WORLD_SIZE": "", "MASTER_ADDR": "  "}) == DistEnv()


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_local_rank_and_local_world_size_default_to_rank_and_world_size(world_size):
    for rank in range(world_size):
        env = DistEnv.from_environ({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
        assert env.rank == env.local_rank == rank
        assert env.world_size == env.local_world_size == world_size
        assert env.num_nodes == 1
        assert env.rank == rank
        assert env.is_distributed == (world_size > 1)


def test_full_torchrun_environment_is_read():
    environ = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    env = DistEnv.from_environ(environ)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.master_addr, env.master_port) == ("node0", 29500)
    assert env.restart_count == 3 and env.agent_store
    assert env.num_nodes == 8 // 4
    assert env.rank != 0


@pytest.mark.parametrize("port", [1, 29500, 65535])
def test_master_port_bounds_are_inclusive(port):
    assert DistEnv.from_environ({**TWO_RANKS, "MASTER_PORT": str(port)}).master_port == port


# ---- validate(): checks that need more than the variables themselves ----


@pytest.mark.parametrize(
    "environ, missing",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
    ],
)
def test_multi_process_env_init_needs_master(capsys, environ, missing):
    env = DistEnv.from_environ(environ)
    with pytest.raises(ConfigError, match=f"needs {missing}"):
        validate(DistConfig(), env)
    expect_exit_2(capsys, validate, DistConfig(), env, variable=missing, fix="torchrun sets both")


def test_master_addr_that_does_not_resolve(capsys):
    env = DistEnv.from_environ({**TWO_RANKS, "MASTER_ADDR": UNRESOLVABLE})
    with pytest.raises(ConfigError, match=rf"MASTER_ADDR='{UNRESOLVABLE}' does not resolve"):
        validate(DistConfig(), env)
    expect_exit_2(capsys, validate, DistConfig(), env, variable="MASTER_ADDR", fix="IP address")


def test_resolvable_master_passes_validation():
    env = DistEnv.from_environ(TWO_RANKS)
    assert validate(DistConfig(backend="gloo"), env) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize("timeout_s", [0, -1, 0.0, float("nan")])
@pytest.mark.parametrize("variable", ["DIST_TIMEOUT_S", "DIST_INIT_TIMEOUT_S"])
def test_non_positive_timeout(capsys, timeout_s, variable):
    config = DistConfig(timeout_s=timeout_s) if variable == "DIST_TIMEOUT_S" else DistConfig(init_timeout_s=timeout_s)
    with pytest.raises(ConfigError, match=variable):
        validate(config, DistEnv())
    expect_exit_2(capsys, validate, config, DistEnv(), variable=variable, fix="positive")


def test_small_positive_timeout_is_accepted():
    assert validate(DistConfig(timeout_s=0.5), DistEnv())[0] == "gloo"


@pytest.mark.parametrize("backend", ["mpi", "NCCL", "ucc", ""])
def test_unknown_backend(capsys, backend):
    with pytest.raises(ConfigError, match="BACKEND="):
        validate(DistConfig(backend=backend), DistEnv())
    line = expect_exit_2(
        capsys, validate, DistConfig(backend=backend), DistEnv(), variable=f"BACKEND={backend!r}", fix="use one of"
    )
    for name in BACKENDS:
        assert name in line


def test_tests_see_no_gpu_unless_marked_gpu():
    """tests/conftest.py hides the GPUs (this process and its children): the CPU-path tests below hold on a GPU
    box too."""
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0


def test_nccl_without_cuda(capsys):
    with pytest.raises(ConfigError, match="BACKEND=nccl needs a CUDA GPU"):
        validate(DistConfig(backend="nccl"), DistEnv())
    expect_exit_2(capsys, validate, DistConfig(backend="nccl"), DistEnv(), variable="BACKEND=nccl", fix="BACKEND=gloo")


def test_auto_backend_without_cuda_is_gloo_on_cpu():
    env = DistEnv.from_environ(TWO_RANKS)
    assert validate(DistConfig(backend="auto"), env) == ("gloo", torch.device("cpu"))


def pretend_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """``count`` GPUs that torch can use (compute capability 9.0, which every CUDA build of torch 2.14 covers)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(ddp_cuda, "device_capability", lambda index: (9, 0))


@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_more_local_processes_than_gpus(monkeypatch, capsys, backend):
    pretend_gpus(monkeypatch, 1)
    env = DistEnv.from_environ({**TWO_RANKS, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=2 processes on this node but only 1 GPU"):
        validate(DistConfig(backend=backend), env)
    expect_exit_2(
        capsys, validate, DistConfig(backend=backend), env, variable="LOCAL_WORLD_SIZE=2", fix="--nproc-per-node=1"
    )


def test_enough_gpus_gives_nccl_on_the_local_rank_device(monkeypatch):
    pretend_gpus(monkeypatch, 2)
    for local_rank in range(2):
        env = DistEnv.from_environ({**TWO_RANKS, "RANK": str(local_rank)})
        assert env.local_rank == local_rank
        backend, device = ddp_dist.resolve_backend("auto", env)
        assert backend == "nccl"
        assert device == torch.device("cuda", local_rank)
        # gloo stays on the CPU even when GPUs are visible
        assert ddp_dist.resolve_backend("gloo", env) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize(
    "init_method, fix",
    [
        pytest.param("mpi://somewhere", "tcp://HOST:PORT", id="unknown-scheme"),
        pytest.param("localhost:29500", "tcp://HOST:PORT", id="no-scheme"),
        pytest.param("tcp://127.0.0.1", "tcp://HOST:PORT", id="tcp-without-port"),
        pytest.param("tcp://127.0.0.1:0", "1-65535", id="tcp-port-zero"),
        pytest.param("tcp://127.0.0.1:70000", "1-65535", id="tcp-port-too-large"),
        pytest.param("tcp://:29500", "host", id="tcp-without-host"),
        pytest.param("file://", "file:///", id="file-without-path"),
        pytest.param(f"tcp://{UNRESOLVABLE}:29500", "IP address", id="tcp-host-unresolvable"),
    ],
)
def test_bad_init_method(capsys, init_method, fix):
    config = DistConfig(init_method=init_method)
    with pytest.raises(ConfigError, match="INIT_METHOD"):
        validate(config, DistEnv())
    expect_exit_2(capsys, validate, config, DistEnv(), variable="INIT_METHOD", fix=fix)


@pytest.mark.parametrize("init_method", ["env://", "tcp://127.0.0.1:29500", "file:///tmp/ddp-lab-init"])
def test_good_init_methods_pass(init_method):
    assert validate(DistConfig(init_method=init_method), DistEnv()) == ("gloo", torch.device("cpu"))


def test_tcp_init_method_needs_no_master_variables():
    env = DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2"})
    assert validate(DistConfig(init_method="tcp://127.0.0.1:29500"), env)[0] == "gloo"


def test_default_timeout_is_finite_and_not_torchs_30_minutes():
    assert 0 < DistConfig().timeout_s == DEFAULT_TIMEOUT_S < 30 * 60


@pytest.mark.parametrize("torch_has_set_timeout", [True, False])
@pytest.mark.filterwarnings("ignore:.*_set_pg_timeout` is deprecated:FutureWarning")  # torch's, on the private call
def test_the_short_timeout_reaches_the_group_on_this_torch_and_on_one_without_set_timeout(
    tmp_path, monkeypatch, torch_has_set_timeout
):
    """torch before 2.12 (a GPU box's own install) has no dist.set_timeout; the private call does the same there."""
    from datetime import timedelta

    import torch.distributed as dist

    monkeypatch.setattr(
        ddp_dist, "_timeout_in_force", dict(ddp_dist._timeout_in_force)
    )  # the module's record, restored after
    if not torch_has_set_timeout:
        monkeypatch.delattr(dist, "set_timeout")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=100)
    )
    try:
        ddp_dist.set_collective_timeout(7)
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
