"""Preflight's probes and verdicts (tools/preflight/): every rank's facts in, one row out. No process group."""

from __future__ import annotations

import copy
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddp_core.exit_codes import FINISHED_EXIT_CODES, PREFLIGHT_FAILED_EXIT_CODE
from ddp_core.torchrun import STATED_EXIT_CODES
from experiments.cifar10_data import make_learnable_images, write_cifar10_format
from tools.preflight import nccl_log, probes, table, verdicts

GIB = verdicts.GIB
CODE = {"root": "/repo", "source": "git", "commit": "a" * 40, "digest": "d" * 64, "files": 30}
GPU = {
    "local_rank": 0,
    "index": 0,
    "visible_devices": None,
    "id": "GPU-0",
    "name": "NVIDIA H100",
    "memory_bytes": 80 * GIB,
    "capability": [9, 0],
    "arch_list": ["sm_80", "sm_90"],
    "runtime_cuda": "13.0",
    "driver_cuda": "13.0",
    "used_bytes": GIB // 2,
    "own_bytes": 0,
}
HOST = {
    "shm": {"path": "/dev/shm", "total_bytes": 8 * GIB, "free_bytes": 8 * GIB},
    "run_dir": {"path": "runs", "checked_at": "/repo", "exists": True, "free_bytes": 50 * GIB, "writable": True},
    "data_dir": {"path": "data", "checked_at": "/repo", "exists": True, "free_bytes": 50 * GIB, "writable": True},
    "dataset": {"dataset": "none"},
    "memlock": None,
    "infiniband": None,
}


def fact(rank: int, local_world: int = 2, gpu: bool = False, **changes: Any) -> dict[str, Any]:
    """One rank's facts as rank_facts() builds them: ``local_world`` ranks per node, changes applied by key."""
    local = rank % local_world
    out = {
        "rank": rank,
        "local_rank": local,
        "node": rank // local_world,
        "host": f"host{rank // local_world}",
        "pid": 100 + rank,
        "versions": {"python": "3.11.7", "torch": "2.14.1", "cuda": "13.0", "nccl": "2.30.7"},
        "code": dict(CODE),
        "env": {"SEED": "0"},
        "ib_requested": False,
        "gpu": {**GPU, "local_rank": local, "index": local, "id": f"GPU-{rank}"} if gpu else None,
        "host_checks": copy.deepcopy(HOST) if local == 0 else None,
        "time": 0.0,
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def world(
    n: int = 4, local_world: int = 2, gpu: bool = False, edits: dict[int, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    edits = edits or {}
    return [fact(r, local_world, gpu, **edits.get(r, {})) for r in range(n)]


# ---------------------------------------------------------------------------------------------------
# versions, code, environment

VERSION_CASES = [
    (
        "torch",
        {3: {"versions": {"torch": "2.13.0"}}},
        {0: "PASS", 1: "FAIL"},
        "node1 (rank 3): torch 2.13.0 (rank 0: 2.14.1)",
    ),
    ("python", {1: {"versions": {"python": "3.11.9"}}}, {0: "FAIL", 1: "PASS"}, "node0 (rank 1): python 3.11.9"),
    (
        "nccl",
        {2: {"versions": {"nccl": "2.21.5"}}, 3: {"versions": {"nccl": "2.21.5"}}},
        {0: "PASS", 1: "FAIL"},
        "node1 (ranks 2-3): nccl 2.21.5",
    ),
    ("cuda", {2: {"versions": {"cuda": "12.8"}}}, {0: "PASS", 1: "FAIL"}, "cuda 12.8 (rank 0: 13.0)"),
]


@pytest.mark.parametrize("edits,nodes,named", [c[1:] for c in VERSION_CASES], ids=[c[0] for c in VERSION_CASES])
def test_a_version_that_differs_fails_naming_the_rank_and_what(edits, nodes, named):
    verdict = verdicts.check_versions(world(edits=edits))
    assert verdict.nodes == nodes and named in verdict.detail and "same versions" in verdict.fix


def test_equal_versions_pass():
    verdict = verdicts.check_versions(world())
    assert verdict.status == "PASS" and "torch 2.14.1" in verdict.detail and verdict.fix == ""


def test_an_edited_file_is_named():
    facts = world(edits={2: {"code": {"digest": "e" * 64}}, 3: {"code": {"digest": "e" * 64}}})
    reference = {"ddp_core/distributed/group.py": "1", "experiments/toy.py": "2", "requirements.txt": "3"}
    edited = {**reference, "experiments/toy.py": "changed"}
    verdict = verdicts.check_code(facts, {0: reference, 2: edited, 3: edited})
    assert verdict.nodes == {0: "PASS", 1: "FAIL"}
    assert (
        "node1 (ranks 2-3): experiments/toy.py (edited)" in verdict.detail and "compared with node0" in verdict.detail
    )
    assert "ddp_core/distributed/group.py" not in verdict.detail and "same ddp-lab code" in verdict.fix


FILE_DIFF_CASES = [
    ("edited", {"a.py": "1"}, {"a.py": "2"}, ["a.py (edited)"]),
    ("missing", {"a.py": "1", "b.py": "2"}, {"a.py": "1"}, ["b.py (missing here)"]),
    ("only here", {"a.py": "1"}, {"a.py": "1", "new.py": "3"}, ["new.py (only here)"]),
    ("same", {"a.py": "1"}, {"a.py": "1"}, []),
]


@pytest.mark.parametrize(
    "reference,other,expected", [c[1:] for c in FILE_DIFF_CASES], ids=[c[0] for c in FILE_DIFF_CASES]
)
def test_diff_files(reference, other, expected):
    assert verdicts.diff_files(reference, other) == expected


def test_many_edited_files_are_counted_beyond_the_first_five():
    reference = {f"f{i}.py": "x" for i in range(9)}
    verdict = verdicts.check_code(
        world(edits={1: {"code": {"digest": "e" * 64}}}), {0: reference, 1: {k: "y" for k in reference}}
    )
    assert "f4.py (edited) and 4 more" in verdict.detail


def test_same_code_on_different_commits_only_warns():
    verdict = verdicts.check_code(world(edits={2: {"code": {"commit": "b" * 40}}, 3: {"code": {"commit": "b" * 40}}}))
    assert verdict.nodes == {0: "PASS", 1: "WARN"} and "bbbbbbbbbbbb on node1" in verdict.detail


def test_code_differences_without_the_file_lists_still_fail():
    verdict = verdicts.check_code(world(edits={1: {"code": {"digest": "e" * 64}}}))
    assert verdict.nodes == {0: "FAIL", 1: "PASS"} and "digest differs" in verdict.detail


def test_file_digests_name_the_edited_file_of_a_copy_without_git(tmp_path: Path):
    for copy_dir in ("a", "b"):
        for name in ("ddp_core/x.py", "experiments/y.py", "requirements.txt", "ddp_core/__pycache__/x.cpython-311.pyc"):
            (tmp_path / copy_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / copy_dir / name).write_text(name)
    (tmp_path / "b" / "experiments" / "y.py").write_text("edited")
    source_a, a = probes.file_digests(tmp_path / "a")
    source_b, b = probes.file_digests(tmp_path / "b")
    assert source_a == source_b == "files" and sorted(a) == ["ddp_core/x.py", "experiments/y.py", "requirements.txt"]
    assert probes.overall_digest(a) != probes.overall_digest(b) and verdicts.diff_files(a, b) == [
        "experiments/y.py (edited)"
    ]


def test_code_files_in_this_checkout_come_from_git_and_cover_what_runs():
    source, names = probes.code_files()
    assert (
        "experiments/preflight.py" in names and "ddp_core/distributed/group.py" in names and "requirements.txt" in names
    )
    assert "tools/preflight/probes.py" in names and "tools/commbench.py" in names
    assert not any(name.startswith(("tests/", "docs/")) for name in names)
    assert source == ("git" if (probes.PROJECT_ROOT / ".git").exists() else "files")


ENV_CASES = [
    (
        "DETERMINISTIC set on one node",
        {2: {"env": {"SEED": "0", "DETERMINISTIC": "1"}}, 3: {"env": {"SEED": "0", "DETERMINISTIC": "1"}}},
        {0: "PASS", 1: "FAIL"},
        "DETERMINISTIC: unset on node0 (ranks 0-1); '1' on node1 (ranks 2-3)",
    ),
    (
        "SEED differs",
        {1: {"env": {"SEED": "7"}}},
        {0: "FAIL", 1: "PASS"},
        "SEED: '0' on node0 (rank 0), node1 (ranks 2-3); '7' on node0 (rank 1)",
    ),
    (
        "an NCCL variable",
        {2: {"env": {"SEED": "0", "NCCL_IB_DISABLE": "1"}}, 3: {"env": {"SEED": "0", "NCCL_IB_DISABLE": "1"}}},
        {0: "PASS", 1: "FAIL"},
        "NCCL_IB_DISABLE: unset on node0",
    ),
    (
        "a per-host interface name",
        {2: {"env": {"SEED": "0", "NCCL_SOCKET_IFNAME": "eth1"}}},
        {0: "PASS", 1: "WARN"},
        "NCCL_SOCKET_IFNAME",
    ),
]


@pytest.mark.parametrize("edits,nodes,named", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_a_variable_that_differs_is_named_with_its_nodes(edits, nodes, named):
    verdict = verdicts.check_environment(world(edits=edits))
    assert verdict.nodes == nodes and named in verdict.detail, verdict.detail
    per_host = nodes[1] == "WARN"
    assert ("the same on every node" in verdict.fix) != per_host and (
        "may legitimately differ per host" in verdict.fix
    ) == per_host


def test_watched_environment_takes_nccl_and_the_run_variables_only():
    environ = {
        "NCCL_DEBUG": "INFO",
        "SEED": "3",
        "DETERMINISTIC": "1",
        "BACKEND": "gloo",
        "HOME": "/root",
        "NCCLX": "1",
        "PATH": "/bin",
    }
    assert probes.watched_environment(environ) == {
        "BACKEND": "gloo",
        "DETERMINISTIC": "1",
        "NCCL_DEBUG": "INFO",
        "SEED": "3",
    }


@pytest.mark.parametrize(
    "environ,flag,expected",
    [
        ({}, False, False),
        ({"NCCL_IB_DISABLE": "0"}, False, True),
        ({"NCCL_IB_DISABLE": "1"}, False, False),
        ({}, True, True),
    ],
)
def test_infiniband_is_checked_only_when_asked_for(environ, flag, expected):
    assert probes.ib_requested(environ, flag) is expected


# ---------------------------------------------------------------------------------------------------
# GPUs: facts from a monkeypatched torch.cuda, verdicts over them


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """A machine with two H100s; ``devices`` can be changed by a test (e.g. both local ranks on index 0)."""
    props = {
        i: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB, major=9, minor=0, uuid=f"GPU-uuid-{i}")
        for i in range(2)
    }
    state = SimpleNamespace(current=0, props=props, arch=["sm_80", "sm_90"], used={0: GIB // 2, 1: GIB // 2})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(state.props))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: state.props[i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: state.arch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (80 * GIB - state.used[i], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 0)
    monkeypatch.setattr(probes, "driver_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return state


def gpu_world(state, devices: list[int], nodes: int = 1) -> list[dict[str, Any]]:
    """Facts of ``len(devices)`` local ranks on each of ``nodes`` nodes, local rank i on device devices[i]."""
    facts = []
    for node in range(nodes):
        for local, index in enumerate(devices):
            state.current = index
            rank = node * len(devices) + local
            facts.append({**fact(rank, len(devices)), "gpu": probes.gpu_facts(local)})
    return facts


def test_gpu_facts_read_torch_cuda(fake_cuda):
    gpu = probes.gpu_facts(0)
    assert gpu["id"] == "GPU-uuid-0" and gpu["capability"] == [9, 0] and gpu["memory_bytes"] == 80 * GIB
    assert gpu["driver_cuda"] == "13.0" and gpu["runtime_cuda"] == "13.0" and gpu["used_bytes"] == GIB // 2


def test_two_local_ranks_on_one_device_fail(fake_cuda):
    verdict = verdicts.check_gpu_devices(gpu_world(fake_cuda, devices=[0, 0]))
    assert verdict.nodes == {0: "FAIL"} and "node0: ranks 0-1 share one GPU (GPU-uuid-0)" in verdict.detail
    assert "its own GPU" in verdict.fix


def test_distinct_devices_pass_and_are_described(fake_cuda):
    verdict = verdicts.check_gpu_devices(gpu_world(fake_cuda, devices=[0, 1], nodes=2))
    assert verdict.nodes == {0: "PASS", 1: "PASS"} and "node1: 2x NVIDIA H100 80GB HBM3 (80.0 GiB)" in verdict.detail


def test_the_same_device_index_on_two_nodes_is_fine(fake_cuda):
    facts = gpu_world(fake_cuda, devices=[0], nodes=2)
    facts[1]["gpu"]["id"] = "GPU-other-host"
    assert verdicts.check_gpu_devices(facts).status == "PASS"


CAPABILITY_CASES = [
    ("listed", (9, 0), ["sm_80", "sm_90"], "PASS"),
    ("not listed", (12, 0), ["sm_75", "sm_80", "sm_90"], "FAIL"),
    ("too old", (6, 1), ["sm_75", "sm_80"], "FAIL"),
    ("PTX only", (9, 0), ["sm_80", "compute_80"], "WARN"),
    ("arch-specific suffix", (9, 0), ["sm_90a"], "PASS"),
    ("arch-specific suffix, another GPU", (10, 0), ["sm_90a"], "FAIL"),
    ("a later minor of the same major", (8, 6), ["sm_75", "sm_80"], "PASS"),
    ("PTX of an older major", (12, 0), ["sm_90", "compute_90"], "WARN"),
]


@pytest.mark.parametrize(
    "capability,arch,expected", [c[1:] for c in CAPABILITY_CASES], ids=[c[0] for c in CAPABILITY_CASES]
)
def test_capability_support(capability, arch, expected):
    assert verdicts.capability_support(capability, arch) == expected


def test_an_unsupported_capability_fails(fake_cuda):
    for p in fake_cuda.props.values():
        p.major, p.minor = 12, 0
    verdict = verdicts.check_gpu_capability(gpu_world(fake_cuda, devices=[0, 1]))
    assert verdict.nodes == {0: "FAIL"} and "is sm_120" in verdict.detail and "arch list" in verdict.fix


DRIVER_CASES = [
    ("same", "13.0", "13.0", "PASS"),
    ("newer", "13.1", "13.0", "PASS"),
    ("older minor", "13.0", "13.2", "WARN"),
    ("older major", "12.4", "13.0", "FAIL"),
    ("unknown", None, "13.0", "WARN"),
]


@pytest.mark.parametrize("driver,runtime,expected", [c[1:] for c in DRIVER_CASES], ids=[c[0] for c in DRIVER_CASES])
def test_driver_new_enough(driver, runtime, expected):
    facts = world(2, local_world=2, gpu=True)
    for f in facts:
        f["gpu"].update(driver_cuda=driver, runtime_cuda=runtime)
    verdict = verdicts.check_gpu_driver(facts)
    assert verdict.status == expected
    assert ("upgrade the NVIDIA driver" in verdict.fix) == (expected != "PASS")


def test_memory_held_by_another_process_warns(fake_cuda):
    fake_cuda.used[1] = 30 * GIB
    verdict = verdicts.check_gpu_memory(gpu_world(fake_cuda, devices=[0, 1]), foreign_limit_bytes=2 * GIB)
    assert verdict.nodes == {0: "WARN"} and "node0 (rank 1): 30.0 GiB" in verdict.detail and "nvidia-smi" in verdict.fix


@pytest.mark.parametrize(
    "check",
    [
        verdicts.check_gpu_devices,
        verdicts.check_gpu_capability,
        verdicts.check_gpu_driver,
        lambda f: verdicts.check_gpu_memory(f, GIB),
    ],
)
def test_gpu_rows_say_skipped_without_cuda(check):
    verdict = check(world())
    assert verdict.nodes == {0: "SKIP", 1: "SKIP"} and verdict.detail == "skipped: no CUDA"


def test_gpu_rows_of_a_gloo_job_on_a_gpu_machine_say_it_runs_on_cpu():
    facts = world(edits={r: {"cuda_available": True} for r in range(4)})
    assert verdicts.check_gpu_devices(facts).detail == "skipped: the job runs on CPU (gloo)"
    args = SimpleNamespace(run_dir="runs", data_dir="data", dataset="none", verify=True, expect_ib=False)
    assert probes.rank_facts(args, rank=1, local_rank=1, node=0, environ={}, device_type="cpu")[0]["gpu"] is None


def test_a_node_without_cuda_in_a_gpu_job_fails():
    facts = world(4, gpu=True)
    facts[2]["gpu"] = facts[3]["gpu"] = None
    verdict = verdicts.check_gpu_devices(facts)
    assert verdict.nodes == {0: "PASS", 1: "FAIL"} and "node1 (rank 2): no CUDA" in verdict.detail


# ---------------------------------------------------------------------------------------------------
# host: shared memory, directories, dataset, memlock, InfiniBand


def with_host(key: str, node1: dict[str, Any] | None) -> list[dict[str, Any]]:
    facts = world()
    facts[2]["host_checks"][key] = node1
    return facts


SHM_CASES = [
    ("Docker's 64 MB", {"path": "/dev/shm", "total_bytes": 64 * 10**6, "free_bytes": 64 * 10**6}, "WARN", "61.0 MiB"),
    ("missing", {"path": "/dev/shm", "error": "No such file or directory"}, "WARN", "no /dev/shm"),
    ("8 GiB", {"path": "/dev/shm", "total_bytes": 8 * GIB, "free_bytes": GIB}, "PASS", "8.0 GiB"),
]


@pytest.mark.parametrize("shm,expected,shown", [c[1:] for c in SHM_CASES], ids=[c[0] for c in SHM_CASES])
def test_shm(shm, expected, shown):
    verdict = verdicts.check_shm(with_host("shm", shm), min_bytes=GIB)
    assert verdict.nodes == {0: "PASS", 1: expected} and f"node1: {shown}" in verdict.detail
    assert ("--shm-size" in verdict.fix) == (expected == "WARN")


def test_shm_facts_of_this_machine():
    shm = probes.shm_facts()
    assert shm["total_bytes"] > 0 if os.path.isdir("/dev/shm") else "error" in shm


RUN_DIR_CASES = [
    ("not writable where rank 0 runs", 0, {"writable": False, "error": "Read-only file system (/mnt)"}, "FAIL"),
    ("not writable on another node", 1, {"writable": False, "error": "Permission denied (/mnt)"}, "WARN"),
    ("full where rank 0 runs", 0, {"free_bytes": GIB // 10}, "FAIL"),
    ("roomy", 0, {}, "PASS"),
]


@pytest.mark.parametrize("node,change,expected", [c[1:] for c in RUN_DIR_CASES], ids=[c[0] for c in RUN_DIR_CASES])
def test_run_dir(node, change, expected):
    facts = world()
    facts[node * 2]["host_checks"]["run_dir"].update(change)
    verdict = verdicts.check_directory(facts, "run_dir", "run_dir", min_free_bytes=GIB, rank0_node=0)
    assert verdict.nodes[node] == expected and verdict.nodes[1 - node] == "PASS"
    assert (f"on node{node}" in verdict.fix) == (expected != "PASS")


def test_an_unwritable_data_dir_only_warns():
    facts = world()
    facts[0]["host_checks"]["data_dir"].update(writable=False, error="Read-only file system (/data)")
    verdict = verdicts.check_directory(facts, "data_dir", "data_dir", 0, rank0_node=0)
    assert verdict.nodes == {0: "WARN", 1: "PASS"} and "--download" in verdict.fix


def test_directory_facts_create_nothing(tmp_path: Path):
    facts = probes.directory_facts(tmp_path / "new" / "run")
    assert facts["writable"] and facts["checked_at"] == str(tmp_path) and facts["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []  # the temp file is gone, and the run directory was not created


def test_directory_facts_under_a_file(tmp_path: Path):
    (tmp_path / "file").write_text("")
    facts = probes.directory_facts(tmp_path / "file" / "run")
    assert facts["writable"] is False and "is not a directory" in facts["error"]


def _without_dac_override() -> None:
    """In the child, before exec: a root process then obeys file modes like any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_DAC_OVERRIDE
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def test_directory_facts_read_only(tmp_path: Path):
    """For real, in a child process: as root without CAP_DAC_OVERRIDE (root writes into a 0555 folder)."""
    tmp_path.chmod(0o555)
    code = (
        f"from tools.preflight import probes; f = probes.directory_facts({str(tmp_path)!r}); "
        "print(f['writable'], f.get('error'))"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
        )
    finally:
        tmp_path.chmod(0o755)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("False ") and "Permission denied" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_dataset_present_and_missing(tmp_path: Path):
    train, test = make_learnable_images(20, seed=0), make_learnable_images(10, seed=1)
    write_cifar10_format(tmp_path / "ok", train.images, train.labels, test.images, test.labels)
    present = probes.dataset_facts("cifar10", tmp_path / "ok", verify=False)
    assert present["ok"] and present["train"] == 20 and present["test"] == 10
    unverified = probes.dataset_facts("cifar10", tmp_path / "ok", verify=True)  # synthetic files: the md5 sums differ
    assert not unverified["ok"] and "md5 differs" in unverified["error"]
    missing = probes.dataset_facts("cifar10", tmp_path / "nothing", verify=True)
    assert not missing["ok"] and "CIFAR10 not found" in missing["error"]
    facts = world()
    facts[0]["host_checks"]["dataset"], facts[2]["host_checks"]["dataset"] = present, missing
    verdict = verdicts.check_dataset(facts)
    assert verdict.nodes == {0: "PASS", 1: "FAIL"} and "--download" in verdict.fix
    assert verdicts.check_dataset(world()).nodes == {0: "SKIP", 1: "SKIP"}


MEMLOCK_CASES = [("unlimited", None, "PASS"), ("docker's 8 MiB", 8 << 20, "FAIL"), ("4 GiB", 4 * GIB, "WARN")]


@pytest.mark.parametrize("soft,expected", [c[1:] for c in MEMLOCK_CASES], ids=[c[0] for c in MEMLOCK_CASES])
def test_memlock_when_infiniband_is_asked_for(soft, expected):
    facts = world(edits={r: {"ib_requested": True} for r in range(4)})
    for f in facts:
        if f["host_checks"]:
            f["host_checks"]["memlock"] = {"soft": None, "hard": None}
    facts[2]["host_checks"]["memlock"] = {"soft": soft, "hard": soft}
    verdict = verdicts.check_memlock(facts)
    assert verdict.nodes == {0: "PASS", 1: expected} and ("ulimit -l unlimited" in verdict.fix) == (expected != "PASS")


def test_infiniband_rows_skip_unless_asked_for_and_fail_without_devices():
    assert verdicts.check_infiniband(world()).nodes == {0: "SKIP", 1: "SKIP"}
    assert verdicts.check_memlock(world()).detail.startswith("skipped: InfiniBand not asked for")
    facts = world(edits={0: {"ib_requested": True}})
    facts[0]["host_checks"]["infiniband"] = {"adapters": ["mlx5_0"], "devices": ["uverbs0"]}
    facts[2]["host_checks"]["infiniband"] = {"adapters": [], "devices": []}
    verdict = verdicts.check_infiniband(facts)
    assert verdict.nodes == {0: "PASS", 1: "FAIL"} and "/dev/infiniband" in verdict.fix


def test_infiniband_facts_read_the_folders(tmp_path: Path):
    (tmp_path / "sys" / "mlx5_0").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "uverbs0").write_text("")
    assert probes.infiniband_facts(str(tmp_path / "sys"), str(tmp_path / "dev")) == {
        "adapters": ["mlx5_0"],
        "devices": ["uverbs0"],
    }
    assert probes.infiniband_facts(str(tmp_path / "none"), str(tmp_path / "none")) == {"adapters": [], "devices": []}


# ---------------------------------------------------------------------------------------------------
# clocks, all_reduce, bandwidth, transport


def test_clock_offset_is_measured_against_the_round_trip_midpoint():
    assert probes.clock_offset(sent=100.0, remote=105.5, received=101.0) == (5.0, 0.5)


CLOCK_CASES = [
    ("in sync", 0.02, "PASS"),
    ("2 s off", -2.0, "WARN"),
    ("2 minutes off", 120.0, "FAIL"),
    ("just under", 0.99, "PASS"),
]


@pytest.mark.parametrize("offset,expected", [c[1:] for c in CLOCK_CASES], ids=[c[0] for c in CLOCK_CASES])
def test_clock_skew_thresholds(offset, expected):
    verdict = verdicts.check_clocks(world(), {1: (offset, 0.001)}, warn_s=1.0, fail_s=60.0)
    assert verdict.nodes == {0: "PASS", 1: expected} and f"node1 {offset:+.3f} s" in verdict.detail
    assert ("chrony" in verdict.fix) == (expected != "PASS")


def test_clock_skew_on_one_node_is_skipped():
    assert verdicts.check_clocks(world(2), {}, 1.0, 60.0).nodes == {0: "SKIP"}


def test_the_all_reduce_input_sums_to_its_closed_form():
    for size in (1, 2, 3, 7):
        assert torch.equal(sum(probes.reduce_input(r, 50) for r in range(size)), probes.reduce_expected(size, 50))
    assert len({tuple(probes.reduce_input(r, 3).tolist()) for r in range(4)}) == 4  # rank-unique


def test_a_wrong_all_reduce_fails_naming_the_rank():
    verdict = verdicts.check_all_reduce(world(), {0: True, 1: True, 2: True, 3: False}, 0.01, 1 << 20)
    assert verdict.nodes == {0: "PASS", 1: "FAIL"} and "node1 (rank 3)" in verdict.detail
    assert verdicts.check_all_reduce(world(), dict.fromkeys(range(4), True), 0.01, 1 << 20).status == "PASS"


def test_a_slow_link_is_named():
    facts = world(6, local_world=2)
    links = [(0, 1, 10.0), (0, 2, 9.0), (1, 2, 2.0)]
    verdict = verdicts.check_bandwidth(facts, links, slow_fraction=0.5, min_gbps=0.0, what="64 MiB")
    assert verdict.nodes == {0: "PASS", 1: "WARN", 2: "WARN"} and "node1<->node2" in verdict.fix
    floor = verdicts.check_bandwidth(facts, links, slow_fraction=0.0, min_gbps=5.0, what="64 MiB")
    assert floor.nodes == {0: "PASS", 1: "FAIL", 2: "FAIL"}
    assert verdicts.check_bandwidth(world(1, 1), [], 0.5, 0.0, "x").status == "SKIP"


NCCL_LOGS = [
    (
        "IB over RoCE",
        "host:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE ; OOB eth0:10.0.0.1<0>\n"
        "host:1:1 [0] NCCL INFO Using network IB\n"
        "host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 2[0] [send] via NET/IB/0/GDRDMA\n",
        {"network": "IB", "link_layers": ["RoCE"], "transports": ["NET/IB"]},
    ),
    (
        "sockets",
        "h:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\nh:1:1 [0] NCCL INFO Using network Socket\n"
        "h:1:1 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0\n"
        "h:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/CUMEM\n",
        {"network": "Socket", "link_layers": [], "transports": ["NET/Socket", "P2P"]},
    ),
    (
        "one node, shared memory",
        "h:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct\n",
        {"network": None, "link_layers": [], "transports": ["SHM"]},
    ),
    (
        "a network plugin",
        "w:30:70 [4] NCCL INFO Using network AWS Libfabric\n"
        "w:27:72 [1] NCCL INFO Channel 00 : 1[101d0] -> 8[101c0] [send] via NET/AWS Libfabric/0/GDRDMA\n"
        "w:27:72 [1] NCCL INFO Channel 00 : 1[1a000] -> 2[af000] via direct shared memory\n",
        {"network": "AWS Libfabric", "link_layers": [], "transports": ["NET/AWS Libfabric", "SHM"]},
    ),
    ("nothing", "", {"network": None, "link_layers": [], "transports": []}),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in NCCL_LOGS], ids=[c[0] for c in NCCL_LOGS])
def test_parse_nccl_log(text, expected):
    assert nccl_log.parse_nccl_log(text) == expected


PLAN_CASES = [
    ("nothing set", {}, "own", None),
    ("the user's WARN on stdout", {"NCCL_DEBUG": "WARN"}, "own", "WARN"),
    ("the user's INFO on stdout", {"NCCL_DEBUG": "info"}, "own", "INFO"),
    (
        "the user's INFO file",
        {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/logs/nccl.%h.%p"},
        "/logs/nccl.node7.42",
        None,
    ),
    ("the user's WARN file", {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": "/logs/nccl.%h.%p"}, "own", "WARN"),
]


@pytest.mark.parametrize("environ,path,echo", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_plan_nccl_log(environ, path, echo):
    plan = nccl_log.plan_nccl_log(environ, pid=42, hostname="node7.cluster.local", temp_dir="/tmp")
    if path == "own":
        assert plan.own and plan.path == "/tmp/ddp-lab-preflight-nccl-42.log"
        assert dict(plan.set) == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": plan.path}
    else:
        assert not plan.own and plan.path == path and plan.set == ()
    assert plan.echo_level == echo


def test_the_user_gets_the_nccl_lines_of_their_own_level_back(tmp_path: Path, capsys):
    from tools.preflight.nccl_log import enable_nccl_log, read_nccl_log

    environ = {"NCCL_DEBUG": "WARN"}
    plan = enable_nccl_log(environ)
    assert environ["NCCL_DEBUG"] == "INFO" and environ["NCCL_DEBUG_FILE"] == plan.path
    Path(plan.path).write_text(
        "h:1:1 [0] NCCL INFO NCCL version 2.30.7+cuda13.0\n"
        "h:1:1 [0] NCCL INFO Using network Socket\nh:1:2 [0] misc.cc:1 NCCL WARN something odd\n"
    )
    assert read_nccl_log(plan)["network"] == "Socket"
    assert capsys.readouterr().out == "h:1:2 [0] misc.cc:1 NCCL WARN something odd\n"
    assert not Path(plan.path).exists()  # preflight's own file is gone
    assert read_nccl_log(nccl_log.NcclLogPlan(path=str(tmp_path / "missing"), own=False)) is None


def test_transport_verdicts():
    gloo = verdicts.check_transport(world(), "gloo", {})
    assert gloo.status == "PASS" and "TCP" in gloo.detail
    sockets = nccl_log.parse_nccl_log(NCCL_LOGS[1][1])
    asked = world(edits={0: {"ib_requested": True}})
    assert verdicts.check_transport(asked, "nccl", {0: sockets, 1: sockets}).status == "FAIL"
    assert verdicts.check_transport(world(), "nccl", {0: sockets, 1: sockets}).status == "WARN"
    roce = verdicts.check_transport(
        asked, "nccl", {0: nccl_log.parse_nccl_log(NCCL_LOGS[0][1]), 1: nccl_log.parse_nccl_log(NCCL_LOGS[0][1])}
    )
    assert roce.status == "PASS" and "network IB (RoCE)" in roce.detail
    unknown = verdicts.check_transport(world(), "nccl", {}, note="NCCL_DEBUG is set: read your log")
    assert unknown.status == "SKIP" and unknown.detail == "NCCL_DEBUG is set: read your log"


# ---------------------------------------------------------------------------------------------------
# the table and the JSON


def verdicts_of(facts: list[dict[str, Any]]) -> list[verdicts.Verdict]:
    return [
        verdicts.check_versions(facts),
        verdicts.check_code(facts),
        verdicts.check_environment(facts),
        verdicts.check_gpu_devices(facts),
        verdicts.check_shm(facts, GIB),
        verdicts.check_directory(facts, "run_dir", "run_dir", GIB, 0),
    ]


def test_the_table_has_a_row_per_check_a_column_per_node_and_a_fix_per_failure():
    facts = world(edits={2: {"versions": {"torch": "2.13.0"}}, 3: {"versions": {"torch": "2.13.0"}}})
    facts[0]["host_checks"]["shm"]["total_bytes"] = 64 * 10**6
    judged = verdicts_of(facts)
    lines = table.render_table(judged, facts, "preflight: test").splitlines()
    assert lines[0] == "preflight: test" and "node0 = host0 (ranks 0-1); node1 = host1 (ranks 2-3)" in lines[1]
    header = next(line for line in lines if line.startswith("check"))
    assert header.split() == ["check", "node0", "node1", "detail"]
    rows = {
        line.split()[0]: line.split()[1:3]
        for line in lines
        if line.split() and line.split()[0] in {v.name for v in judged}
    }
    assert (
        rows["versions"] == ["PASS", "FAIL"]
        and rows["shm"] == ["WARN", "PASS"]
        and rows["gpu_devices"] == ["SKIP", "SKIP"]
    )
    fixes = [line for line in lines if line.startswith(("FAIL ", "WARN "))]
    assert fixes[0].startswith("FAIL versions: install the same versions") and fixes[1].startswith("WARN shm: ")
    assert lines[-1] == "preflight FAILED: 3 PASS, 1 WARN, 1 FAIL, 1 SKIP"


def test_many_nodes_share_one_column():
    facts = world(2 * (table.MAX_NODE_COLUMNS + 1), local_world=2)
    printed = table.render_table(verdicts_of(facts), facts, "t")
    assert f"{table.MAX_NODE_COLUMNS + 1} nodes" in printed and "node12 " not in printed.split("\n", 3)[3]


def test_the_json_holds_the_same_rows():
    facts = world(edits={3: {"env": {"SEED": "1"}}})
    judged = verdicts_of(facts)
    document = json.loads(table.dumps(table.report(judged, facts, "gloo", "cpu", PREFLIGHT_FAILED_EXIT_CODE)))
    assert document["ok"] is False and document["exit_code"] == PREFLIGHT_FAILED_EXIT_CODE
    assert document["world"] == {"world_size": 4, "nodes": 2, "backend": "gloo", "device": "cpu"}
    assert document["nodes"] == [
        {"node": 0, "host": "host0", "ranks": [0, 1]},
        {"node": 1, "host": "host1", "ranks": [2, 3]},
    ]
    assert [c["name"] for c in document["checks"]] == [v.name for v in judged]
    environment = document["checks"][2]
    assert environment == {
        "name": "environment",
        "status": "FAIL",
        "nodes": {"node0": "PASS", "node1": "FAIL"},
        "detail": judged[2].detail,
        "fix": judged[2].fix,
        "data": {},
    }


def test_the_exit_code_is_stated_for_workers_and_torchrun():
    assert PREFLIGHT_FAILED_EXIT_CODE == 4
    assert PREFLIGHT_FAILED_EXIT_CODE in FINISHED_EXIT_CODES and PREFLIGHT_FAILED_EXIT_CODE in STATED_EXIT_CODES


def test_facts_survive_pickling_as_plain_data(tmp_path: Path):
    """Facts cross nodes whose code may differ: plain dicts, nothing this module defines."""
    import pickle

    args = SimpleNamespace(
        run_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "data"), dataset="none", verify=True, expect_ib=True
    )
    facts, digests = probes.rank_facts(
        args, rank=0, local_rank=0, node=0, environ={"SEED": "1", "NCCL_IB_DISABLE": "0"}
    )
    assert b"tools.preflight" not in pickle.dumps(facts)
    assert facts["env"] == {"NCCL_IB_DISABLE": "0", "SEED": "1"} and facts["ib_requested"] is True
    assert set(facts["host_checks"]) == {"shm", "run_dir", "data_dir", "dataset", "memlock", "infiniband"}
    assert facts["code"]["digest"] == probes.overall_digest(digests) and facts["gpu"] is None
