"""ddp_core/distributed/cuda.py: a driver torch cannot use and a GPU torch has no kernels for are refused in one line.

No GPU needed: NVML, /proc and torch.cuda's queries are replaced by fakes (tests/conftest.py has already
hidden any real GPU; a test's own monkeypatch comes after it).
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from ddp_core.distributed import cuda as ddp_cuda
from ddp_core.distributed.cuda import Driver, arch_supports, nvml_driver, proc_driver_version, visible_gpus
from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.group import resolve_backend
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE

OLD_DRIVER = Driver(version="470.82.01", cuda="11.4", gpus=2)  # runs CUDA up to 11.4: too old for a cu130 wheel
NEW_DRIVER = Driver(version="580.65.06", cuda="13.0", gpus=2)
NO_GPU_DRIVER = Driver(version="580.65.06", cuda="13.0", gpus=0)
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130's get_arch_list()
TWO_LOCAL = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def machine(
    monkeypatch: pytest.MonkeyPatch,
    driver: Driver | None,
    cuda_available: bool,
    hidden: bool = False,
    built_for: str | None = "13.0",
    capability: tuple[int, int] = (9, 0),
    archs: list[str] = CU130_ARCHS,
) -> list[int]:
    """A pretend machine; returns the list of GPU indices whose capability was asked for."""
    asked: list[int] = []
    monkeypatch.setattr(ddp_cuda, "nvml_driver", lambda: driver)
    monkeypatch.setattr(ddp_cuda, "proc_driver_version", lambda: None)
    monkeypatch.setattr(torch.version, "cuda", built_for)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda_available else 0)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)
    monkeypatch.setattr(ddp_cuda, "device_capability", lambda index: asked.append(index) or capability)
    monkeypatch.setattr(ddp_cuda, "device_name", lambda index: "NVIDIA GeForce GTX 1080")
    if hidden:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the user hid the GPUs: CPU on purpose
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return asked


def one_line_exit_2(capsys, fn, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        exits_with_one_line(fn)(*args)
    assert info.value.code == CONFIG_ERROR_EXIT_CODE
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


TOO_OLD = (
    r"driver 470\.82\.01 sees 2 GPU\(s\) and runs CUDA up to 11\.4, but torch \S+ was built for CUDA 13\.0"
    r" \(driver >= 580\.65\.06\).*upgrade the NVIDIA driver.*CUDA 11\.4 or older.*BACKEND=gloo"
)
NEEDS_GPU = "BACKEND=nccl needs a CUDA GPU"
CPU, GPU1 = ("gloo", torch.device("cpu")), ("nccl", torch.device("cuda", 1))

# (driver NVML reports, torch.cuda.is_available(), CUDA_VISIBLE_DEVICES="", BACKEND) -> (backend, device) or an error
COMBINATIONS = [
    (OLD_DRIVER, False, False, "auto", TOO_OLD),  # the silent CPU run this refuses
    (OLD_DRIVER, False, False, "nccl", TOO_OLD),  # the cause, not "needs a CUDA GPU"
    (OLD_DRIVER, False, False, "gloo", CPU),  # CPU asked for: allowed
    (OLD_DRIVER, False, True, "auto", CPU),  # GPUs hidden on purpose
    (OLD_DRIVER, False, True, "nccl", NEEDS_GPU),
    (
        NEW_DRIVER,
        False,
        False,
        "auto",
        r"driver 580\.65\.06 .* cannot initialise CUDA: check that this process can open the devices.*BACKEND=gloo",
    ),
    (NO_GPU_DRIVER, False, False, "auto", CPU),  # a driver, no GPU
    (None, False, False, "auto", CPU),  # no driver at all: this CPU machine
    (None, False, False, "nccl", NEEDS_GPU),
    (NEW_DRIVER, True, False, "auto", GPU1),
    (NEW_DRIVER, True, False, "nccl", GPU1),
    (NEW_DRIVER, True, False, "gloo", CPU),
]


@pytest.mark.parametrize(("driver", "cuda_available", "hidden", "backend", "expected"), COMBINATIONS)
def test_backend_for_each_driver_and_cuda_combination(
    monkeypatch, capsys, driver, cuda_available, hidden, backend, expected
):
    machine(monkeypatch, driver, cuda_available, hidden)
    env = DistEnv.from_environ(TWO_LOCAL)
    if isinstance(expected, tuple):
        assert resolve_backend(backend, env) == expected
        return
    with pytest.raises(ConfigError, match=expected):
        resolve_backend(backend, env)
    one_line_exit_2(capsys, resolve_backend, backend, env)


def test_a_cpu_only_torch_on_a_gpu_machine_is_refused(monkeypatch):
    machine(monkeypatch, NEW_DRIVER, cuda_available=False, built_for=None)
    with pytest.raises(
        ConfigError, match=r"torch \S+ is a build without CUDA: install a CUDA build of torch, or set BACKEND=gloo"
    ):
        resolve_backend("auto", DistEnv.from_environ(TWO_LOCAL))


def test_the_driver_version_comes_from_proc_when_nvml_does_not_say(monkeypatch):
    machine(monkeypatch, Driver(version=None, cuda=None, gpus=1), cuda_available=False)
    monkeypatch.setattr(ddp_cuda, "proc_driver_version", lambda: "470.82.01")
    with pytest.raises(
        ConfigError, match=r"driver 470\.82\.01 sees 1 GPU\(s\), but .* CUDA 13\.0 \(driver >= 580\.65\.06\)"
    ):
        resolve_backend("auto", DistEnv())


@pytest.mark.parametrize(
    ("capability", "archs", "supported"),
    [
        ((9, 0), CU130_ARCHS, True),
        ((6, 1), CU130_ARCHS, False),  # a GTX 1080: cu130 wheels need 7.5+
        ((7, 0), CU130_ARCHS, False),  # a V100
        ((12, 1), ["sm_80", "compute_90"], True),  # PTX for 9.0 is compiled by the driver for a newer GPU
    ],
)
def test_a_gpu_torch_has_no_kernels_for_is_refused_naming_it(monkeypatch, capsys, capability, archs, supported):
    asked = machine(monkeypatch, NEW_DRIVER, cuda_available=True, capability=capability, archs=archs)
    env = DistEnv.from_environ(TWO_LOCAL)
    if supported:
        assert resolve_backend("auto", env) == GPU1
    else:
        major, minor = capability
        with pytest.raises(
            ConfigError,
            match=rf"GPU 1 \(NVIDIA GeForce GTX 1080\) has compute capability {major}\.{minor}, "
            rf"but torch \S+ has kernels only for {re.escape(' '.join(archs))}:.*sm_{major}{minor}.*BACKEND=gloo",
        ):
            resolve_backend("auto", env)
        one_line_exit_2(capsys, resolve_backend, "nccl", env)
    assert set(asked) == {1}  # each rank checks its own GPU (LOCAL_RANK=1)


def test_gloo_never_looks_at_the_gpus(monkeypatch):
    asked = machine(monkeypatch, NEW_DRIVER, cuda_available=True, capability=(6, 1))
    assert resolve_backend("gloo", DistEnv.from_environ(TWO_LOCAL)) == CPU
    assert asked == []


@pytest.mark.parametrize(
    ("archs", "capability", "expected"),
    [
        (CU130_ARCHS, (7, 5), True),
        (CU130_ARCHS, (8, 9), True),  # sm_86 machine code runs on 8.9 (same major, later minor)
        (CU130_ARCHS, (7, 0), False),
        (["sm_75", "sm_80", "sm_90"], (10, 0), False),  # machine code never runs on a newer major
        (["sm_80", "compute_80"], (12, 0), True),  # PTX runs on every later GPU
        (["compute_90"], (8, 6), False),  # but never on an earlier one
        (["sm_86"], (8, 0), False),
        (["sm_90a"], (9, 0), True),  # "a": that exact GPU only
        (["sm_90a"], (10, 0), False),
        (["compute_90a"], (10, 0), False),
        (["sm_100f"], (10, 3), True),  # "f": the family (same major)
        (["sm_100f"], (12, 0), False),
        (["sm_120"], (12, 1), True),
        (["gfx90a", "bogus"], (9, 0), False),  # not a CUDA arch entry
        ([], (9, 0), False),
    ],
)
def test_which_arch_entries_run_on_which_gpu(archs, capability, expected):
    assert arch_supports(archs, capability) is expected


def test_no_arch_list_means_no_verdict(monkeypatch):
    """ROCm builds (torch.version.cuda is None) and builds without a list: nothing to compare, nothing refused."""
    machine(monkeypatch, NEW_DRIVER, cuda_available=True, capability=(3, 0), archs=[])
    assert ddp_cuda.unsupported_gpu_message(0) is None
    machine(monkeypatch, NEW_DRIVER, cuda_available=True, capability=(3, 0), built_for=None)
    assert ddp_cuda.unsupported_gpu_message(0) is None


@pytest.mark.parametrize(
    ("machine_gpus", "listed", "expected"),
    [
        (4, None, 4),
        (4, "", 0),
        (4, "-1", 0),
        (4, "0,1", 2),
        (4, " 1 , 2 ", 2),
        (4, "0,-1,1", 1),  # CUDA stops at the first entry that is not a GPU
        (4, "GPU-8f6c1d2e,MIG-1a2b", 2),
        (2, "0,5", 1),
        (0, "0", 0),
    ],
)
def test_cuda_visible_devices_is_read_the_way_cuda_reads_it(machine_gpus, listed, expected):
    environ = {} if listed is None else {"CUDA_VISIBLE_DEVICES": listed}
    assert visible_gpus(machine_gpus, environ) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
            "GCC version:  gcc 12\n",
            "535.104.05",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n",
            "580.65.06",
        ),
        ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  550.54  Tue Mar  5 2024\n", "550.54"),
        ("something else entirely\n", None),
        (None, None),  # no file: no driver
    ],
)
def test_the_driver_version_in_proc(tmp_path, text, expected):
    path = tmp_path / "version"
    if text is not None:
        path.write_text(text)
    assert proc_driver_version(path) == expected


class FakeNvml:
    """libnvidia-ml.so.1 as ctypes sees it: each function fills its out-arguments and returns NVML_SUCCESS (0)."""

    def __init__(self, init_rc: int = 0):
        self.init_rc, self.shutdown = init_rc, 0

    def nvmlInit_v2(self):
        return self.init_rc

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = 4
        return 0

    def nvmlSystemGetDriverVersion(self, text, size):
        assert size >= 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE
        text.value = b"550.54.15"
        return 0

    def nvmlSystemGetCudaDriverVersion_v2(self, version):
        version._obj.value = 12040
        return 0

    def nvmlShutdown(self):
        self.shutdown += 1
        return 0


@pytest.mark.parametrize(
    ("library", "expected", "shutdowns"),
    [
        (FakeNvml(), Driver(version="550.54.15", cuda="12.4", gpus=4), 1),
        (FakeNvml(init_rc=9), None, 0),  # NVML_ERROR_DRIVER_NOT_LOADED
        (OSError("libnvidia-ml.so.1: cannot open shared object file"), None, 0),  # no driver installed
    ],
)
def test_nvml_is_read_through_ctypes_and_absent_is_none(monkeypatch, library, expected, shutdowns):
    def load(name):
        assert name == "libnvidia-ml.so.1"
        if isinstance(library, OSError):
            raise library
        return library

    monkeypatch.setattr(ctypes, "CDLL", load)
    assert nvml_driver() == expected
    if not isinstance(library, OSError):
        assert library.shutdown == shutdowns


def test_describe_device(monkeypatch):
    monkeypatch.setattr(ddp_cuda, "device_name", lambda index: f"NVIDIA H100 80GB HBM3 #{index}")
    assert ddp_cuda.describe_device(torch.device("cpu")) == "cpu"
    assert ddp_cuda.describe_device(torch.device("cuda", 3)) == "cuda:3 NVIDIA H100 80GB HBM3 #3"


@pytest.mark.parametrize(("number", "dotted"), [(91002, "9.10.2"), (90100, "9.1.0"), (8902, "8.9.2"), (8600, "8.6.0")])
def test_cudnn_versions_are_dotted(number, dotted):
    assert ddp_cuda._dotted_cudnn(number) == dotted
