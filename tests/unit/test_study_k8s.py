"""``python -m tools.study --launcher k8s`` without a cluster: the Indexed Job it writes validates against the
Kubernetes schemas (strict, offline, as tests/unit/test_k8s_manifests.py checks docker/k8s/), each pod reads back
its own run from the tasks file, the pod's variables make one standalone run through the image's entrypoint, and
``--apply`` goes through a stand-in kubectl (applied, waited for, each unfinished run's pod log read)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ddp_core import entrypoint
from ddp_core.errors import ConfigError
from tools.study import Combination, Study, Task, main
from tools.study.k8s import TASKS_FILE, manifests
from tools.study.task import read_task

# backoffLimitPerIndex and podFailurePolicy's FailIndex are on by default from 1.29; and the newest the package knows
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
ARGV = ["toy", "--seeds", "2", "--grid", "lr=0.05,0.2", "--nproc", "2", "--launcher", "k8s"]


def _study(tmp_path: Path) -> tuple[Study, list[Task]]:
    study = Study(
        "toy",
        "toy-lr",
        tmp_path / "runs" / "studies" / "toy-lr",
        2,
        {"lr": ["0.05", "0.2"]},
        2,
        ["--steps", "50"],
        "k8s",
    )
    tasks = [
        Task(combination, seed, study.dir / combination.folder / f"seed-{seed}", study.dir / "logs" / "x.log", None)
        for combination in (Combination((("lr", value),)) for value in ("0.05", "0.2"))
        for seed in range(2)
    ]
    return study, tasks


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {item["kind"]: item for item in objects}


def _trainer(job: dict) -> dict:
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    return trainer


@pytest.mark.parametrize(("parallel", "gpus"), [(None, None), (3, 0)])
def test_the_indexed_job_validates_and_runs_one_pod_per_run(tmp_path, parallel, gpus):
    study, tasks = _study(tmp_path)
    objects = manifests(study, tasks, "study-toy-lr-1", parallel, gpus)
    for version in KUBERNETES_VERSIONS:
        for item in objects:
            kubernetes_validate.validate(item, version, strict=True)
    kinds = _by_kind(objects)
    assert set(kinds) == {"PersistentVolumeClaim", "ConfigMap", "Job"}
    job = kinds["Job"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == 4
    assert job["parallelism"] == (parallel or 4) and job["backoffLimitPerIndex"] == 0  # a failed run, not the Job
    pod = job["template"]["spec"]
    assert "initContainers" not in pod and "subdomain" not in pod and pod["restartPolicy"] == "Never"
    trainer = _trainer(kinds["Job"])
    assert trainer["command"] == ["python3", "-m", "tools.study.task"]
    limits = trainer.get("resources", {}).get("limits", {})
    assert limits == ({"nvidia.com/gpu": 2} if gpus is None else {})  # by default a GPU per process
    # the runs' volume is the claim this file declares; the tasks file is the ConfigMap, mounted where STUDY_TASKS says
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in trainer["volumeMounts"]}
    claim = kinds["PersistentVolumeClaim"]["metadata"]["name"]
    assert volumes[mounts["/app/runs"]["name"]]["persistentVolumeClaim"]["claimName"] == claim
    env = {variable["name"]: variable["value"] for variable in trainer["env"]}
    folder, file = env["STUDY_TASKS"].rsplit("/", 1)
    assert volumes[mounts[folder]["name"]]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    assert file in kinds["ConfigMap"]["data"]


def test_each_pod_reads_its_own_run_and_the_entrypoint_makes_one_standalone_run(tmp_path, monkeypatch):
    study, tasks = _study(tmp_path)
    kinds = _by_kind(manifests(study, tasks, "study-toy-lr-1", None, None))
    tasks_file = tmp_path / TASKS_FILE
    tasks_file.write_text(kinds["ConfigMap"]["data"][TASKS_FILE])
    env = {variable["name"]: variable["value"] for variable in _trainer(kinds["Job"])["env"]}
    monkeypatch.setattr(entrypoint, "check_resolves", lambda *args: None)
    for index, task in enumerate(tasks):
        run_dir, flags = read_task({"STUDY_TASKS": str(tasks_file), "JOB_COMPLETION_INDEX": str(index)})
        # the same run directory, as the pod mounts the volume's runs/ at /app/runs
        assert run_dir == f"/app/runs/{task.run_dir.relative_to(tmp_path / 'runs').as_posix()}"
        assert flags == [*study.flags, *task.combination.argv, "--seed", str(task.seed)]
        command = entrypoint.torchrun_command({**env, "RUN_DIR": run_dir}, flags)
        assert "--standalone" in command and "--nproc-per-node=2" in command  # one node: a port of its own
        assert command[command.index("-m", 3) :] == ["-m", "experiments.toy", *flags]


def test_a_pod_started_again_resumes_and_a_missing_task_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000010.pt").write_bytes(b"x")
    tasks_file = tmp_path / "tasks.tsv"
    tasks_file.write_text(f"{run_dir}\t--steps\t50\t--seed\t1\n")
    environ = {"STUDY_TASKS": str(tasks_file), "JOB_COMPLETION_INDEX": "0"}
    assert read_task(environ) == (str(run_dir), ["--steps", "50", "--seed", "1", "--resume"])
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=1: .* has 1 line"):
        read_task({**environ, "JOB_COMPLETION_INDEX": "1"})
    with pytest.raises(ConfigError, match="a study's pod needs both"):
        read_task({"STUDY_TASKS": str(tasks_file)})


def test_without_apply_it_writes_the_job_prints_the_command_and_exits_0(tmp_path, capsys, clean_env):
    runs = tmp_path / "runs"
    assert main([*ARGV, "--runs-dir", str(runs), "--parallel", "2", "--", "--steps", "50"]) == 0
    path = runs / "studies" / "toy-lr" / "job.yaml"
    err = capsys.readouterr().err
    assert f"kubectl apply -f {path}" in err
    for item in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(item, KUBERNETES_VERSIONS[-1], strict=True)
    job = _by_kind(list(yaml.safe_load_all(path.read_text())))["Job"]["spec"]
    assert (job["completions"], job["parallelism"]) == (4, 2)
    (tasks,) = (runs / "studies" / "toy-lr").glob("k8s-tasks-*.tsv")  # the same lines as the Job's ConfigMap
    assert len(tasks.read_text().splitlines()) == 4


def test_apply_without_kubectl_is_one_line_exit_2(tmp_path, capsys, clean_env):
    clean_env.setenv("PATH", str(tmp_path))  # no kubectl there
    with pytest.raises(SystemExit) as refused:
        main([*ARGV, "--apply", "--runs-dir", str(tmp_path / "runs"), "--", "--steps", "50"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: --apply: kubectl is not on PATH") and err.count("\n") == 1


KUBECTL = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/calls"
case $1 in
  apply) echo "job.batch/x created";;
  get) echo '{"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "FailedIndexes"}]}}';;
  logs) echo "Traceback ..."; echo "error: rank 0 raised RuntimeError: no GPU on this node";;
esac
"""


def test_apply_waits_for_the_job_then_lists_each_unfinished_run_with_its_pods_last_line(tmp_path, capsys, clean_env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    clean_env.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    runs = tmp_path / "runs"
    assert main([*ARGV, "--apply", "--runs-dir", str(runs), "--", "--steps", "50"]) == 1
    root = runs / "studies" / "toy-lr"
    calls = (bin_dir / "calls").read_text().splitlines()
    (job,) = [line.split("\t")[0] for line in (root / "k8s-jobs.txt").read_text().splitlines()]
    assert calls[0] == f"apply -f {root / 'job.yaml'}" and calls[1] == f"get job {job} -o json"
    assert sum(call.startswith("logs -l ") and f"job-name={job}" in call for call in calls) == 4
    err = capsys.readouterr().err
    assert "4 run(s) did not finish" in err
    assert err.count(": failed: error: rank 0 raised RuntimeError: no GPU on this node (log ") == 4, err
