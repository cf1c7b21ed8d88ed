"""A real Docker engine for the tests: the stand-in base image, the project image, compose.

No registry is reachable here, so the real CUDA base image cannot be pulled: the tests build a stand-in
(Debian bookworm's Python 3.11 with the project's pinned requirements, torch 2.14.1 included) and pass
it as the Dockerfile's BASE_IMAGE. It is tagged by the hash of requirements.txt and reused while that
file does not change.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
# Debian's client: it builds with BuildKit (DOCKER_BUILDKIT=1); the 28.x client in /usr/local/bin has no buildx.
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
LOCAL_INDEXES = [p for p in ("/opt/pypi", "/opt/pypi-more") if Path(p, "simple").is_dir()]
IMAGE_FILES = ("requirements.txt", "ddp_core", "experiments", "tools", "docker", "docker-compose.yml", ".dockerignore")


def docker(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    # the environment read now, as tests/conftest.py left it for the test, not as the shell had it at import
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    result = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def engine_available() -> bool:
    try:
        return docker("info", check=False, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextmanager
def temporary_network(prefix: str) -> Iterator[str]:
    """A user-defined bridge network (containers reach each other by name), removed afterwards."""
    name = f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"
    docker("network", "create", name)
    try:
        yield name
    finally:
        docker("network", "rm", name, check=False)


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def standin_base_image() -> str:
    """Debian bookworm + Python 3.11 venv with requirements.txt installed, as the Dockerfile's BASE_IMAGE."""
    digest = hashlib.sha256((REPO / "requirements.txt").read_bytes()).hexdigest()[:12]
    tag = f"ddp-lab-standin:{digest}"
    if image_exists(tag):
        return tag
    stage0 = f"ddp-lab-standin:{digest}-stage0"
    debootstrap = subprocess.Popen(
        ["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    imported = subprocess.run(
        [DOCKER, "import", "-", stage0], stdin=debootstrap.stdout, capture_output=True, text=True, timeout=900
    )
    debootstrap.wait(timeout=60)
    assert debootstrap.returncode == 0 and imported.returncode == 0, (
        f"mmdebstrap | docker import failed: {imported.stderr}"
    )
    container = f"ddp-lab-standin-build-{digest}"
    docker("rm", "-f", container, check=False)
    mounts = [f"-v{path}:{path}:ro" for path in LOCAL_INDEXES]
    indexes = " ".join(f"--extra-index-url file://{path}/simple" for path in LOCAL_INDEXES)
    install = (
        "python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir --cert /etc/ssl/certs/host-ca.crt"
        f" {indexes} -r /tmp/requirements.txt"
    )
    docker(
        "run",
        "--name",
        container,
        *mounts,
        f"-v{HOST_CA}:/etc/ssl/certs/host-ca.crt:ro",
        f"-v{REPO / 'requirements.txt'}:/tmp/requirements.txt:ro",
        stage0,
        "sh",
        "-c",
        install,
        timeout=1800,
    )
    docker(
        "commit",
        "--change",
        "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        container,
        tag,
        timeout=1800,
    )
    docker("rm", container)
    docker("rmi", stage0, check=False)
    return tag


def copy_build_context(destination: Path) -> Path:
    """The files the image and compose need, away from the working tree's own .env, runs/ and data/."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in IMAGE_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, destination / name)
    return destination


def build_image(context: Path, tag: str, base: str) -> subprocess.CompletedProcess:
    return docker(
        "build",
        "--progress=plain",
        "-f",
        "docker/Dockerfile",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "-t",
        tag,
        ".",
        cwd=context,
        timeout=1800,
    )


def layers(tag: str) -> list[str]:
    return docker("image", "inspect", "--format", "{{range .RootFS.Layers}}{{println .}}{{end}}", tag).stdout.split()
