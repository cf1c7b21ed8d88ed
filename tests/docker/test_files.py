"""The Docker files, checked without an engine: lint, what goes into the image, compose validity."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.docker.conftest import REPO, require_tool

pytestmark = pytest.mark.docker


def test_hadolint_passes_on_the_dockerfile():
    hadolint = shutil.which("hadolint") or str(Path(REPO, ".venv/bin/hadolint"))
    require_tool("hadolint", Path(hadolint).exists())
    result = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(REPO / "docker" / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_takes_its_base_as_an_argument_and_runs_as_a_user():
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=pytorch/pytorch:2.14.1-" in text and "FROM ${BASE_IMAGE}" in text
    assert "torch==2.14.1" in (REPO / "requirements.txt").read_text()  # the base image's torch is the pinned one
    assert "\nUSER 1000:1000\n" in text and "syntax=" not in text  # no BuildKit-only syntax line
    # dependencies are installed before the code is copied: a code change keeps that layer cached
    assert text.index("pip install") < text.index("COPY ddp_core") < text.index("ENTRYPOINT")


def test_dockerignore_keeps_secrets_history_and_data_out():
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*" and {".env", ".git", ".venv", "runs", "data"} <= set(lines)
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"requirements.txt", "ddp_core", "experiments", "tools"}


def _config(compose: list[str], folder: Path, *files: str) -> dict:
    args = [part for f in files for part in ("-f", f)]
    result = subprocess.run([*compose, *args, "--profile", "cpu", "config"], cwd=folder, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """The compose files alone, away from any .env in the working tree."""
    shutil.copy(REPO / "docker-compose.yml", tmp_path)
    (tmp_path / "docker").mkdir()
    for name in ("compose.multihost.yml", "compose.infiniband.yml"):
        shutil.copy(REPO / "docker" / name, tmp_path / "docker")
    return tmp_path


def test_compose_is_valid_without_a_dotenv(compose_commands, project_copy, monkeypatch):
    for name in ("EXPERIMENT", "NPROC_PER_NODE", "UID", "GID", "TENSORBOARD_BIND", "IMAGE"):
        monkeypatch.delenv(name, raising=False)
    for compose in compose_commands:
        services = _config(compose, project_copy)["services"]
        assert set(services) == {"trainer", "trainer-cpu", "tensorboard"}
        gpu = services["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
        cpu = services["trainer-cpu"]
        assert cpu["environment"]["BACKEND"] == "gloo" and str(cpu["environment"]["NPROC_PER_NODE"]) == "2"
        assert "deploy" not in cpu and cpu["ipc"] == "host" and cpu["user"] == "1000:1000"
        for name in ("trainer", "trainer-cpu"):
            assert "ports" not in services[name]  # the rendezvous port is never published
        port = services["tensorboard"]["ports"][0]
        published = port if isinstance(port, str) else f"{port.get('host_ip')}:{port['published']}:{port['target']}"
        assert published.startswith("127.0.0.1:6006:6006")


def test_compose_reads_the_dotenv(compose_commands, project_copy):
    (project_copy / ".env").write_text(
        "EXPERIMENT=cifar10\nNPROC_PER_NODE=4\nUID=1234\nGID=99\nTENSORBOARD_PORT=7000\n"
    )
    for compose in compose_commands:
        services = _config(compose, project_copy)["services"]
        assert services["trainer"]["environment"]["EXPERIMENT"] == "cifar10"
        assert str(services["trainer-cpu"]["environment"]["NPROC_PER_NODE"]) == "4"
        assert services["trainer"]["user"] == "1234:99"
        assert "7000" in str(services["tensorboard"]["ports"][0])


def test_multihost_override_uses_host_networking_and_the_nvidia_runtime(compose_commands, project_copy):
    (project_copy / ".env").write_text("NNODES=2\nNODE_RANK=1\nMASTER_ADDR=10.0.0.5\nNCCL_SOCKET_IFNAME=eth1\n")
    for compose in compose_commands:
        trainer = _config(compose, project_copy, "docker-compose.yml", "docker/compose.multihost.yml")["services"][
            "trainer"
        ]
        assert trainer["network_mode"] == "host" and trainer["runtime"] == "nvidia"
        environment = trainer["environment"]
        assert (str(environment["NNODES"]), str(environment["NODE_RANK"]), environment["MASTER_ADDR"]) == (
            "2",
            "1",
            "10.0.0.5",
        )
        assert environment["NCCL_SOCKET_IFNAME"] == "eth1" and environment["EXPERIMENT"] == "toy"


MULTIHOST = ("docker-compose.yml", "docker/compose.multihost.yml")
INFINIBAND = (*MULTIHOST, "docker/compose.infiniband.yml")


def _devices(service: dict) -> list[tuple[str, str]]:
    """(host path, container path) of each device: v1 prints "src:dst", v2 a mapping."""
    pairs = []
    for device in service.get("devices", []):
        if isinstance(device, str):
            pairs.append(tuple(device.split(":")[:2]))
        else:
            pairs.append((device["source"], device["target"]))
    return pairs


def test_multihost_default_is_tcp_and_claims_no_infiniband(compose_commands, project_copy):
    """The plain multi-host file maps no RDMA device, so it says sockets outright; a .env from
    before (NCCL_IB_DISABLE=0) cannot make it claim InfiniBand."""
    (project_copy / ".env").write_text("NNODES=2\nMASTER_ADDR=10.0.0.5\nNCCL_IB_DISABLE=0\n")
    for compose in compose_commands:
        trainer = _config(compose, project_copy, *MULTIHOST)["services"]["trainer"]
        assert str(trainer["environment"]["NCCL_IB_DISABLE"]) == "1"
        assert _devices(trainer) == [] and "IPC_LOCK" not in trainer.get("cap_add", []) and "ulimits" not in trainer
        # NCCL_DEBUG=INFO then shows the transport; an empty list would silence every INFO line
        assert trainer["environment"]["NCCL_DEBUG_SUBSYS"] == "INIT,NET"


def test_infiniband_override_maps_the_rdma_devices_and_unlocks_memory(compose_commands, project_copy):
    (project_copy / ".env").write_text(
        "NNODES=2\nMASTER_ADDR=10.0.0.5\nNCCL_IB_HCA=mlx5_0:1,mlx5_1:1\nNCCL_IB_GID_INDEX=3\n"
    )
    for compose in compose_commands:
        trainer = _config(compose, project_copy, *INFINIBAND)["services"]["trainer"]
        assert ("/dev/infiniband", "/dev/infiniband") in _devices(trainer)
        assert "IPC_LOCK" in trainer["cap_add"]
        memlock = trainer["ulimits"]["memlock"]
        assert (memlock["soft"], memlock["hard"]) == (-1, -1)
        assert trainer["network_mode"] == "host" and trainer["runtime"] == "nvidia" and trainer["ipc"] == "host"
        environment = {k: str(v) for k, v in trainer["environment"].items()}
        assert environment["NCCL_IB_DISABLE"] == "0"
        assert (environment["NCCL_IB_HCA"], environment["NCCL_IB_GID_INDEX"]) == ("mlx5_0:1,mlx5_1:1", "3")
        assert (environment["NNODES"], environment["MASTER_ADDR"]) == ("2", "10.0.0.5")  # the rest still layered
        # built with libibverbs, under its own tag, from the same context and base as the plain image
        assert str(trainer["build"]["args"]["WITH_RDMA"]) == "1" and trainer["image"] == "ddp-lab:rdma"
        assert trainer["build"]["args"]["BASE_IMAGE"].startswith("pytorch/pytorch:2.14.1-")


def test_the_image_installs_libibverbs_only_when_asked_for():
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert "ARG WITH_RDMA=0" in text
    rdma = text[text.index("ARG WITH_RDMA=0") : text.index("COPY requirements.txt")]
    assert 'if [ "$WITH_RDMA" = "1" ]' in rdma and "libibverbs1" in rdma and "ibverbs-providers" in rdma
    assert "rm -rf /var/lib/apt/lists/*" in rdma  # no package lists left in the layer


def test_transport_choice_is_in_the_files_themselves():
    """Without any Compose: read the YAML. The default file hard-codes sockets and maps nothing; the
    InfiniBand file has every piece RDMA needs in a container; the CPU service never gets them."""
    default = yaml.safe_load((REPO / "docker" / "compose.multihost.yml").read_text())["services"]
    assert default["trainer"]["environment"]["NCCL_IB_DISABLE"] == "1"  # a string, not a variable
    assert not {"devices", "cap_add", "ulimits"} & set(default["trainer"])
    infiniband = yaml.safe_load((REPO / "docker" / "compose.infiniband.yml").read_text())["services"]
    assert set(infiniband) == {"trainer"}
    trainer = infiniband["trainer"]
    assert trainer["devices"] == ["/dev/infiniband:/dev/infiniband"] and trainer["cap_add"] == ["IPC_LOCK"]
    assert trainer["ulimits"] == {"memlock": {"soft": -1, "hard": -1}} and trainer["network_mode"] == "host"
    assert trainer["environment"]["NCCL_IB_DISABLE"] == "0"
    documented = (REPO / ".env.example").read_text()
    assert "\nNCCL_IB_DISABLE=" not in documented  # the files pick the transport, not a variable
    for name in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX"):
        assert f"\n{name}=" in documented, name


def test_compose_files_avoid_keys_one_compose_version_rejects():
    for path in (
        REPO / "docker-compose.yml",
        REPO / "docker" / "compose.multihost.yml",
        REPO / "docker" / "compose.infiniband.yml",
    ):
        data = yaml.safe_load(path.read_text())
        assert not {"version", "name", "include"} & set(data), path
        for service in data["services"].values():
            assert not {"gpus", "develop"} & set(service), path


def test_slurm_scripts_are_valid_bash_and_run_ddp_lab_torchrun_under_srun():
    """Both scripts: ddp-lab's torchrun under srun, a signal before the time limit, requeue on exit 143, resume.
    That they do it on a real Slurm: tests/slurm (make slurm-check)."""
    for name, nodes in (("slurm.sbatch", "#SBATCH --nodes=2"), ("slurm-cpu.sbatch", "#SBATCH --nodes=1")):
        script = REPO / "docker" / name
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, name
        text = script.read_text()
        assert (
            nodes in text and "srun --kill-on-bad-exit=1" in text and ".venv/bin/python -m ddp_core.torchrun" in text
        ), name
        assert "--rdzv-backend=c10d" in text and "--rdzv-conf=join_timeout=" in text, name
        for line in (
            "#SBATCH --signal=B:TERM@",
            "#SBATCH --requeue",
            "#SBATCH --open-mode=append",
            "trap forward_stop TERM",
        ):
            assert line in text, (name, line)
        assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "status == 143" in text and "resume=(--resume)" in text, (
            name
        )


HANG_AND_STOP_VARIABLES = {
    "TORCH_DISTRIBUTED_DEBUG": "OFF",
    "NCCL_DEBUG": "WARN",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_DUMP_TEMP_FILE": "",  # the run directory's, in the runs volume, unless a user names a prefix
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "50",
}


def test_hang_diagnostics_and_the_stop_grace_reach_the_trainers(compose_commands, project_copy, monkeypatch):
    """The switches that find a hang are passed through (flight-recorder dumps land in the run directory),
    and `docker stop` waits longer than torchrun gives its workers to checkpoint."""
    for name in HANG_AND_STOP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    documented = (REPO / ".env.example").read_text()
    for compose in compose_commands:
        services = _config(compose, project_copy)["services"]
        for service in ("trainer", "trainer-cpu"):
            environment = {k: str(v) for k, v in services[service]["environment"].items()}
            assert {k: environment.get(k) for k in HANG_AND_STOP_VARIABLES} == HANG_AND_STOP_VARIABLES
            grace = services[service]["stop_grace_period"]
            assert grace in ("60s", "1m0s", 60, 60.0), grace
            assert int(environment["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < 60
    for name in HANG_AND_STOP_VARIABLES:
        assert f"\n{name}=" in documented or f"\n# {name}=" in documented, name
