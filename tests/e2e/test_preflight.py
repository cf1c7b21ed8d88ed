"""Preflight end to end: real torchrun jobs on CPU (gloo), one node and two nodes on this machine.

The two-node tests run each node from its own copy of the code (as two hosts would), started by its
own torchrun agent with static rendezvous.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_core.exit_codes import PREFLIGHT_FAILED_EXIT_CODE
from ddp_core.process.launch import free_port
from tests import prefork
from tests.e2e.launch import REPO, clean_env
from tools.preflight.probes import code_files

CHECKS = [
    "versions",
    "code",
    "environment",
    "network",
    "gpu_devices",
    "gpu_capability",
    "gpu_driver",
    "gpu_memory",
    "shm",
    "run_dir",
    "data_dir",
    "dataset",
    "memlock",
    "infiniband",
    "clock_skew",
    "all_reduce",
    "bandwidth",
    "transport",
]
SHORT = ("--bandwidth-mib", "1", "--bandwidth-reps", "2")  # a few seconds of checks in all


def preflight(
    nproc: int, *args: str, cwd: Path = REPO, torchrun_args: tuple[str, ...] = ("--standalone",), **env: str
) -> subprocess.Popen:
    """``python -m ddp_core.torchrun ... -m experiments.preflight`` (what `make train` and the image run). From this
    repository, the processes fork from tests/prefork.py's server (torch imported once); from a copy of the code,
    they are real interpreters, which import that copy."""
    command = [
        prefork.python() if cwd == REPO else sys.executable,
        "-m",
        "ddp_core.torchrun",
        *torchrun_args,
        f"--nproc-per-node={nproc}",
        "-m",
        "experiments.preflight",
        *SHORT,
        *args,
    ]
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=clean_env(DIST_INIT_TIMEOUT_S="60", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def rows(stdout: str) -> dict[str, list[str]]:
    """check name -> its cells (statuses, then the detail's words) from the printed table."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check "))
    table = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        name, *cells = line.split()
        table[name] = cells
    return table


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_healthy_one_node_job_passes_with_one_table_and_every_check_in_the_json(
    tmp_path: Path, nproc: int, data_dir: Path
):
    dataset = (
        ("--dataset", "cifar10", "--data-dir", str(data_dir), "--no-verify") if nproc == 3 else ()
    )  # the synthetic fixture
    code, out, err = finish(
        preflight(nproc, "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "preflight.json"), *dataset)
    )
    assert code == 0, out[-3000:] + err[-3000:]
    assert out.count("preflight: 1 node(s)") == 1 and out.count("preflight passed") == 1  # rank 0 alone prints
    table = rows(out)
    assert list(table) == CHECKS
    assert all(
        table[name][0] == "PASS"
        for name in ("versions", "code", "environment", "shm", "run_dir", "all_reduce", "bandwidth", "transport")
    )
    assert table["gpu_devices"][:4] == ["SKIP", "skipped:", "no", "CUDA"]
    assert table["dataset"][:3] == (["PASS", "node0:", "cifar10"] if dataset else ["SKIP", "skipped:", "no"])
    document = json.loads((tmp_path / "preflight.json").read_text())
    assert document["ok"] is True and document["exit_code"] == 0
    assert document["world"] == {"world_size": nproc, "nodes": 1, "backend": "gloo", "device": "cpu"}
    assert [c["name"] for c in document["checks"]] == CHECKS
    assert {c["name"]: c["status"] for c in document["checks"]} == {name: cells[0] for name, cells in table.items()}
    assert not (tmp_path / "run").exists()  # checked, not created


def test_a_failing_check_exits_with_the_stated_code_and_a_fix_line(tmp_path: Path):
    (tmp_path / "a-file").write_text("")
    code, out, err = finish(
        preflight(2, "--run-dir", str(tmp_path / "a-file" / "run"), "--json", str(tmp_path / "preflight.json"))
    )
    assert code == PREFLIGHT_FAILED_EXIT_CODE, out[-3000:] + err[-3000:]
    assert rows(out)["run_dir"][0] == "FAIL"
    assert (
        f"FAIL run_dir: make {tmp_path / 'a-file' / 'run'} writable by this user on node0 (or choose another --run-dir)"
        in out
    )
    assert "preflight FAILED" in out
    assert "error: preflight: 1 check(s) failed (run_dir): the table above says how to fix each" in err
    assert "Traceback" not in err and "ChildFailedError" not in err  # torchrun exits with the workers' code, no summary
    document = json.loads((tmp_path / "preflight.json").read_text())
    assert document["ok"] is False and document["exit_code"] == PREFLIGHT_FAILED_EXIT_CODE


def copy_code(destination: Path) -> Path:
    """What a host holds: the code files (as the image does), without .git."""
    _, names = code_files(REPO)
    for name in names:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, destination / name)
    return destination


def run_two_nodes(
    copies: tuple[Path, Path], tmp_path: Path, node_env: tuple[dict[str, str], dict[str, str]] = ({}, {})
) -> list[tuple[int, str, str]]:
    port = free_port()
    agents = []
    for node_rank in (0, 1):
        torchrun_args = (
            "--nnodes=2",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--rdzv-conf=timeout=60",
        )
        agents.append(
            preflight(
                1,
                "--run-dir",
                str(tmp_path / "run"),
                cwd=copies[node_rank],
                torchrun_args=torchrun_args,
                **node_env[node_rank],
            )
        )
    return [finish(agent) for agent in agents]


def test_two_nodes_from_identical_copies_pass(tmp_path: Path):
    copies = (copy_code(tmp_path / "node0"), copy_code(tmp_path / "node1"))
    outcomes = run_two_nodes(copies, tmp_path)
    assert [code for code, _, _ in outcomes] == [0, 0], "\n\n".join(o[-3000:] + e[-3000:] for _, o, e in outcomes)
    out = outcomes[0][1]
    assert (
        "preflight: 2 node(s), 2 rank(s)" in out
        and "preflight passed" in outcomes[0][1]
        and "preflight" not in outcomes[1][1]
    )
    table = rows(out)
    assert table["code"][:2] == ["PASS", "PASS"] and table["environment"][:2] == ["PASS", "PASS"]
    assert table["clock_skew"][:2] == ["PASS", "PASS"] and re.search(
        r"against rank 0's clock: node1 [+-]0\.\d+ s", out
    )  # measured
    assert table["bandwidth"][:2] == ["PASS", "PASS"] and "node0<->node1" in out


def test_two_nodes_with_an_edited_file_and_a_different_variable_fail_naming_both(tmp_path: Path):
    copies = (copy_code(tmp_path / "node0"), copy_code(tmp_path / "node1"))
    with open(copies[1] / "experiments" / "toy.py", "a") as handle:
        handle.write("# edited on node 1 only\n")
    outcomes = run_two_nodes(copies, tmp_path, node_env=({}, {"DETERMINISTIC": "1"}))
    assert [code for code, _, _ in outcomes] == [PREFLIGHT_FAILED_EXIT_CODE] * 2, "\n\n".join(
        o[-3000:] + e[-3000:] for _, o, e in outcomes
    )
    out = outcomes[0][1]
    table = rows(out)
    assert table["code"][:2] == ["PASS", "FAIL"]
    code_line = next(line for line in out.splitlines() if line.startswith("code "))
    assert "node1 (rank 1): experiments/toy.py (edited) (compared with node0, rank 0)" in code_line
    assert (
        table["environment"][:2] == ["PASS", "FAIL"]
        and "DETERMINISTIC: unset on node0 (rank 0); '1' on node1 (rank 1)" in out
    )
    assert (
        "FAIL code: run the same ddp-lab code on every node" in out
        and "FAIL environment: set DETERMINISTIC the same" in out
    )
    assert table["versions"][:2] == ["PASS", "PASS"] and table["all_reduce"][:2] == ["PASS", "PASS"]
    assert "error: preflight: 2 check(s) failed (code, environment)" in outcomes[0][2]
