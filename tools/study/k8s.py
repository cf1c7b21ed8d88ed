"""``--launcher k8s``: the study's runs as one Kubernetes Indexed Job built from docker/k8s/job.yaml: pod N runs
line N+1 of the tasks file (``task_lines``) as a standalone run on the shared runs volume, which ``--runs-dir``
must be (docs/decisions.md, "Studies"). Written to job.yaml; with ``--apply``, applied and waited for."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ddp_core.errors import ConfigError
from ddp_core.exit_codes import STOPPED_EXIT_CODE
from tools.study.local import Ending
from tools.study.slurm import task_lines, wait_for

if TYPE_CHECKING:
    from tools.study.grid import Study, Task

MANIFESTS = Path(__file__).resolve().parents[2] / "docker" / "k8s" / "job.yaml"
TASKS_MOUNT = "/etc/ddp-lab-study"
TASKS_FILE = "tasks.tsv"
K8S_POLL_S = 5.0  # how often kubectl is asked whether the Job has ended
# The ConfigMap's variables that describe the 2-node job; every other one (timeouts, NCCL, the flight recorder)
# each run's pod gets as it is. The seed is the study's, on each task line.
MULTI_NODE = frozenset({"NNODES", "NPROC_PER_NODE", "MASTER_ADDR", "RDZV_BACKEND", "SEED"})


def job_name(study: Study, stamp: str) -> str:
    """A DNS label for each submission: pods are named <job>-<index>, at most 63 characters."""
    slug = re.sub(r"[^a-z0-9]+", "-", study.name.lower()).strip("-")[:32].strip("-") or "study"
    return f"study-{slug}-{stamp}"


def pod_path(study: Study, job: dict) -> Callable[[Path], str]:
    """How a run directory reads inside the pod: under the trainer's mount of the volume's runs/."""
    (mount,) = [m["mountPath"] for m in _trainer(job)["volumeMounts"] if m.get("subPath") == "runs"]
    runs_dir = study.dir.parent.parent  # RUNS_DIR/studies/NAME
    return lambda run_dir: f"{mount}/{run_dir.relative_to(runs_dir).as_posix()}"


def _load() -> dict[str, dict]:
    import yaml

    return {item["kind"]: item for item in yaml.safe_load_all(MANIFESTS.read_text()) if item}


def _trainer(job: dict) -> dict:
    (trainer,) = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
    return trainer


def manifests(study: Study, todo: list[Task], name: str, parallel: int | None, gpus_per_run: int | None) -> list[dict]:
    """The claim (as docker/k8s/job.yaml declares it), the tasks as a ConfigMap, and the Indexed Job."""
    base = _load()
    tasks = "\n".join(task_lines(study, todo, pod_path(study, base["Job"]))) + "\n"
    labels = {"app.kubernetes.io/name": "ddp-lab", "ddp-lab/study": name}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}}
    config["data"] = {TASKS_FILE: tasks}
    job = copy.deepcopy(base["Job"])
    pod = job["spec"]["template"]["spec"]
    trainer = _trainer(job)
    variables = {key: value for key, value in base["ConfigMap"]["data"].items() if key not in MULTI_NODE}
    variables.update(EXPERIMENT=study.experiment, NPROC_PER_NODE=str(study.nproc))
    variables["STUDY_TASKS"] = f"{TASKS_MOUNT}/{TASKS_FILE}"
    trainer.update(
        command=["python3", "-m", "tools.study.task"],  # reads its line, then runs the image's entrypoint
        args=[],
        env=[{"name": key, "value": value} for key, value in variables.items()],
    )
    for key in ("envFrom", "ports"):
        trainer.pop(key, None)
    gpus = study.nproc if gpus_per_run is None else gpus_per_run
    if gpus:
        trainer["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    else:
        trainer.pop("resources", None)
    trainer["volumeMounts"].append({"name": "study-tasks", "mountPath": TASKS_MOUNT, "readOnly": True})
    pod["volumes"].append({"name": "study-tasks", "configMap": {"name": name}})
    for key in ("initContainers", "subdomain"):  # the wait for node 0 and the preflight: a 2-node job's
        pod.pop(key, None)
    job["metadata"] = {"name": name, "labels": labels}
    job["spec"]["template"]["metadata"] = {"labels": labels}
    job["spec"].update(
        completions=len(todo),
        parallelism=min(parallel or len(todo), len(todo)),
        backoffLimitPerIndex=0,  # a failed run fails its own index; the others go on
        podFailurePolicy={
            "rules": [  # not failures: the pod starts again and resumes from its checkpoint
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {
                    "action": "Ignore",
                    "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [STOPPED_EXIT_CODE]},
                },
            ]
        },
    )
    job["spec"].pop("backoffLimit", None)  # per index instead
    return [base["PersistentVolumeClaim"], config, job]


def write(study: Study, todo: list[Task], parallel: int | None, gpus_per_run: int | None) -> tuple[str, Path]:
    import yaml

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d%H%M%S")
    name = job_name(study, stamp)
    objects = manifests(study, todo, name, parallel, gpus_per_run)
    (study.dir / f"k8s-tasks-{stamp}.tsv").write_text(objects[1]["data"][TASKS_FILE])
    path = study.dir / "job.yaml"
    header = (
        f"# Study {study.name}: {len(todo)} run(s) as the Indexed Job {name} (python -m tools.study --launcher k8s)."
        "\n# Pod N runs line N+1 of the ConfigMap's tasks.tsv; the run directories are on the claim ddp-lab-runs.\n"
    )
    path.write_text(header + yaml.safe_dump_all(objects, sort_keys=False))
    return name, path


def _kubectl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout)


def ended(name: str) -> bool:
    """The Job has a Complete or Failed condition (every index done, or given up)."""
    shown = _kubectl("get", "job", name, "-o", "json", timeout=60)
    if shown.returncode != 0:
        return False  # the API server busy: ask again
    conditions = json.loads(shown.stdout).get("status", {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


def run_k8s(
    study: Study, todo: list[Task], parallel: int | None, gpus_per_run: int | None, apply: bool
) -> list[Ending] | None:
    """Writes the Job; with ``apply``, applies it, waits for it and returns the runs that did not finish."""
    if apply and shutil.which("kubectl") is None:
        raise ConfigError("--apply: kubectl is not on PATH (install it, or leave --apply out and apply job.yaml)")
    name, path = write(study, todo, parallel, gpus_per_run)
    if not apply:
        print(
            f"study {study.name}: {len(todo)} run(s) as the Indexed Job {name} in {path}\n"
            f"  kubectl apply -f {path}\n"
            f"Once the Job has ended, the same command reports (and writes a Job for the runs that did not finish).",
            file=sys.stderr,
        )
        return None
    applied = _kubectl("apply", "-f", str(path))
    if applied.returncode != 0:
        raise ConfigError(
            f"kubectl apply exited {applied.returncode}: {(applied.stderr or applied.stdout).strip()[-500:]}"
        )
    print(
        f"study {study.name}: Indexed Job {name}, {len(todo)} pod(s) ({path}). Stopping here leaves it running: "
        "the same command collects the results.",
        file=sys.stderr,
    )
    with open(study.dir / "k8s-jobs.txt", "a") as record:
        record.write(f"{name}\t{len(todo)}\n")

    def pod_log(index: int) -> Path:
        log = study.dir / "logs" / f"k8s-{name}_{index}.out"
        selector = f"batch.kubernetes.io/job-name={name},batch.kubernetes.io/job-completion-index={index}"
        log.write_text(_kubectl("logs", "-l", selector, "--tail=200").stdout)
        return log

    return wait_for(study, todo, lambda: not ended(name), pod_log, K8S_POLL_S)
