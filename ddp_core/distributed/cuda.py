"""What the NVIDIA driver and torch say about this machine's GPUs. GPUs torch cannot use (a driver too old for its
CUDA, no kernels for the compute capability) are a one-line ConfigError, not a silent CPU run; every probe gives
None / 0 without a driver (docs/decisions.md, "Ready for the first GPU")."""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ddp_core.errors import ConfigError

PROC_VERSION = Path("/proc/driver/nvidia/version")
# The oldest Linux driver each CUDA major version runs on (NVIDIA's minor-version compatibility table).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
ON_PURPOSE = "set BACKEND=gloo to train on CPU on purpose"


@dataclass(frozen=True)
class Driver:
    """What NVML reports; NVML ignores CUDA_VISIBLE_DEVICES, so ``gpus`` counts every GPU of the machine."""

    version: str | None  # "550.54.15"
    cuda: str | None  # the newest CUDA this driver runs, "12.4"
    gpus: int


def _nvml_call(lib: ctypes.CDLL, name: str, *args: object) -> bool:
    function = getattr(lib, name, None)
    return function is not None and function(*args) == 0  # NVML_SUCCESS


def nvml_driver() -> Driver | None:
    """The driver as NVML sees it; None without the library (no driver, or a container without GPUs)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if not _nvml_call(lib, "nvmlInit_v2"):
        return None
    try:
        count, cuda = ctypes.c_uint(0), ctypes.c_int(0)
        text = ctypes.create_string_buffer(96)  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE is 80
        gpus = count.value if _nvml_call(lib, "nvmlDeviceGetCount_v2", ctypes.byref(count)) else 0
        found = _nvml_call(lib, "nvmlSystemGetDriverVersion", text, len(text))
        version = text.value.decode(errors="replace") if found else None
        cuda_text = None
        if _nvml_call(lib, "nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(cuda)) and cuda.value > 0:
            cuda_text = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}"  # 12040 -> "12.4"
        return Driver(version=version or None, cuda=cuda_text, gpus=gpus)
    finally:
        _nvml_call(lib, "nvmlShutdown")


def proc_driver_version(path: Path = PROC_VERSION) -> str | None:
    """The kernel module's version from /proc ("NVRM version: NVIDIA UNIX ... Kernel Module  550.54.15  ...")."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return found.group(1) if found else None


def driver_version() -> str | None:
    """The NVIDIA driver's version, or None where there is none."""
    driver = nvml_driver()
    return (driver.version if driver else None) or proc_driver_version()


def visible_gpus(machine_gpus: int, environ: Mapping[str, str]) -> int:
    """How many of the machine's GPUs CUDA_VISIBLE_DEVICES leaves, read as CUDA does: up to the first entry that is
    not a GPU ("-1" hides all, "0,-1,1" leaves one); UUIDs ("GPU-...", "MIG-...") count one each."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return machine_gpus
    count = 0
    for entry in (item.strip() for item in listed.split(",")):
        if entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < machine_gpus):
            count += 1
        else:
            break
    return min(count, machine_gpus)


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def unusable_driver_message(driver: Driver, environ: Mapping[str, str]) -> str | None:
    """Why torch cannot use the GPUs this driver sees, as one line; None when it sees none (or they are hidden)."""
    visible = visible_gpus(driver.gpus, environ)
    if visible == 0:
        return None  # no GPU, or CUDA_VISIBLE_DEVICES hides them all: CPU is what the user asked for
    built_for = torch.version.cuda
    found = f"the NVIDIA driver {driver.version or '(version unknown)'} sees {visible} GPU(s)"
    if driver.cuda:
        found += f" and runs CUDA up to {driver.cuda}"
    if not built_for:
        return (
            f"{found}, but torch {torch.__version__} is a build without CUDA: install a CUDA build of torch, "
            f"or {ON_PURPOSE}"
        )
    needs = MIN_DRIVER.get(int(built_for.split(".")[0]))
    wanted = f"torch {torch.__version__} was built for CUDA {built_for}" + (f" (driver >= {needs})" if needs else "")
    if driver.cuda and _major_minor(driver.cuda) >= _major_minor(built_for):  # new enough: something else blocks
        return (
            f"{found}, but torch {torch.__version__} (CUDA {built_for}) cannot initialise CUDA: check that this "
            f"process can open the devices (/dev/nvidia*, permissions, the container runtime's --gpus), or {ON_PURPOSE}"
        )
    older = f"CUDA {driver.cuda} or older" if driver.cuda else "the CUDA version this driver runs"
    return (
        f"{found}, but {wanted} and cannot use them: upgrade the NVIDIA driver, or use an image / torch wheel "
        f"built for {older}, or {ON_PURPOSE}"
    )


def refuse_unusable_driver(environ: Mapping[str, str] | None = None) -> None:
    """Call when ``torch.cuda.is_available()`` is False and GPUs are wanted: never fall back to CPU silently."""
    driver = nvml_driver()
    if driver is None:
        return
    if driver.version is None:
        driver = Driver(version=proc_driver_version(), cuda=driver.cuda, gpus=driver.gpus)
    message = unusable_driver_message(driver, os.environ if environ is None else environ)
    if message:
        raise ConfigError(message)


_ARCH = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


def arch_runs_on(entry: str, capability: tuple[int, int]) -> bool:
    """Whether an entry of ``torch.cuda.get_arch_list()`` runs on ``capability``: ``sm_XY`` on major X, minor >= Y;
    PTX ``compute_XY`` on XY and later; ``sm_90a`` on exactly 9.0; ``sm_100f`` like ``sm_100``."""
    match = _ARCH.match(entry)
    if not match:
        return False
    kind, digits, suffix = match.groups()
    arch = (int(digits[:-1]), int(digits[-1]))
    if suffix == "a":
        return arch == capability
    if kind == "compute" and not suffix:
        return capability >= arch
    return capability[0] == arch[0] and capability[1] >= arch[1]


def arch_supports(arch_list: Sequence[str], capability: tuple[int, int]) -> bool:
    return any(arch_runs_on(entry, capability) for entry in arch_list)


def device_capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def unsupported_gpu_message(index: int) -> str | None:
    """One line when torch has no kernels for GPU ``index``; None when it has (or cannot say: ROCm, no list)."""
    arch_list = list(torch.cuda.get_arch_list()) if torch.version.cuda else []
    if not arch_list:
        return None
    capability = device_capability(index)
    if arch_supports(arch_list, capability):
        return None
    major, minor = capability
    return (
        f"GPU {index} ({device_name(index)}) has compute capability {major}.{minor}, but torch {torch.__version__} has "
        f"kernels only for {' '.join(arch_list)}: install a torch build whose torch.cuda.get_arch_list() includes "
        f"sm_{major}{minor} (builds for older CUDA versions cover older GPUs, newer ones newer GPUs), or {ON_PURPOSE}"
    )


def refuse_unsupported_gpus(indices: Sequence[int]) -> None:
    for index in indices:
        message = unsupported_gpu_message(index)
        if message:
            raise ConfigError(message)


def describe_device(device: torch.device) -> str:
    """ "cuda:0 NVIDIA H100 80GB HBM3" or "cpu", for the manifest."""
    if device.type != "cuda":
        return device.type
    index = torch.cuda.current_device() if device.index is None else device.index
    return f"cuda:{index} {device_name(index)}"


def _dotted_cudnn(version: int) -> str:
    """cuDNN 9 encodes 9.10.2 as 91002; cuDNN 8 encoded 8.9.2 as 8902."""
    if version >= 90000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def library_versions() -> dict[str, str | None]:
    """cuDNN and NCCL as this process loads them; None on a machine where CUDA is not available."""
    cudnn = nccl = None
    if torch.cuda.is_available():
        number = torch.backends.cudnn.version()
        cudnn = _dotted_cudnn(number) if number else None
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    return {"cudnn": cudnn, "nccl": nccl}
