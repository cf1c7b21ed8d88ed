"""docker/k8s/: the Kubernetes manifests, checked without a cluster.

The API's own schemas (shipped inside kubernetes-validate, so offline) catch misspelt or misplaced
fields; the tests below check what the schemas cannot: that the pieces agree with each other and
with what ddp_core.entrypoint reads.
"""

from __future__ import annotations

import copy
import re
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ddp_core import entrypoint

K8S = Path(__file__).resolve().parents[2] / "docker" / "k8s"
JOB_YAML = K8S / "job.yaml"
# The oldest Kubernetes still in common use that has everything used here (Indexed Jobs with pod
# hostnames, the job-completion-index annotation), and the newest the package knows.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def load(text: str | None = None) -> dict[str, dict]:
    documents = [d for d in yaml.safe_load_all(JOB_YAML.read_text() if text is None else text) if d]
    by_kind = {d["kind"]: d for d in documents}
    assert len(by_kind) == len(documents), "one object of each kind"
    return by_kind


def pod_spec(objects: dict[str, dict]) -> dict:
    return objects["Job"]["spec"]["template"]["spec"]


def container(objects: dict[str, dict], name: str) -> dict:
    spec = pod_spec(objects)
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def environment(item: dict, index: int, pod_name: str = "ddp-lab-0-x7k2p") -> dict[str, str]:
    """The container's variables as the kubelet would set them in pod `index` (downward API, $(VAR))."""
    resolved: dict[str, str] = {}
    for variable in item.get("env", []):
        if "value" in variable:
            value = re.sub(r"\$\((\w+)\)", lambda m: resolved.get(m.group(1), m.group(0)), variable["value"])
        else:
            field = variable["valueFrom"]["fieldRef"]["fieldPath"]
            value = {INDEX_ANNOTATION: str(index), "metadata.name": pod_name}[field]
        assert isinstance(value, str), variable  # the API takes strings only (the schema says so too)
        resolved[variable["name"]] = value
    return resolved


def gpus(item: dict) -> int:
    return int(item["resources"]["limits"]["nvidia.com/gpu"])


def test_every_object_validates_against_the_kubernetes_schemas_offline():
    objects = load()
    assert set(objects) == {"PersistentVolumeClaim", "Service", "NetworkPolicy", "Job"}
    for version in KUBERNETES_VERSIONS:
        for item in objects.values():
            kubernetes_validate.validate(item, version, strict=True)  # strict: unknown fields are errors
    # the validator is not a rubber stamp: a misspelt field and a number where a string belongs fail
    misspelt = copy.deepcopy(objects["Job"])
    pod_spec({"Job": misspelt})["volumes"][0]["emptyDir"]["medum"] = "Memory"
    unquoted = copy.deepcopy(objects["Job"])
    container({"Job": unquoted}, "trainer")["env"][1]["value"] = 2
    for broken in (misspelt, unquoted):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_applies_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests == {"job.yaml"}


def test_one_pod_per_node_and_the_node_count_agrees_everywhere():
    objects = load()
    job = objects["Job"]["spec"]
    assert job["completionMode"] == "Indexed"
    nnodes = int(environment(container(objects, "trainer"), 0)["NNODES"])
    assert job["parallelism"] == job["completions"] == nnodes > 1
    # a failed pod fails the job at once (the others are stopped), as srun --kill-on-bad-exit does
    assert job["backoffLimit"] == 0 and pod_spec(objects)["restartPolicy"] == "Never"


def test_gpu_limit_equals_the_processes_per_pod():
    objects = load()
    for name in ("preflight", "trainer"):
        item = container(objects, name)
        assert gpus(item) == int(environment(item, 0)["NPROC_PER_NODE"]) > 0, name
    # a container without a GPU limit may see every GPU of the node: the wait needs none and asks for none
    assert "resources" not in container(objects, "wait-for-node-0")


def test_master_addr_is_pod_0_through_the_headless_service():
    objects = load()
    service, job, spec = objects["Service"], objects["Job"], pod_spec(objects)
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()  # the service selects the job's pods
    assert spec["subdomain"] == service["metadata"]["name"]  # which gives pod i the name <job>-i.<service>
    node0 = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    (port,) = service["spec"]["ports"]
    trainer = container(objects, "trainer")
    assert [p["containerPort"] for p in trainer["ports"]] == [port["port"]] == [port["targetPort"]]
    for name in ("trainer", "wait-for-node-0"):
        for index in (0, 1):
            env = environment(container(objects, name), index)
            assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["NODE_RANK"]) == (node0, str(port["port"]), str(index))
    assert environment(trainer, 1)["RDZV_BACKEND"] == "c10d"
    # Kubernetes' Service variables stay out: a Service named "master" would set MASTER_PORT=tcp://...
    assert spec["enableServiceLinks"] is False
    # only the job's own pods reach its ports
    policy = objects["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert [source["podSelector"]["matchLabels"] for source in policy["ingress"][0]["from"]] == [policy["podSelector"]["matchLabels"]]


def test_shm_is_memory_backed_and_runs_are_on_the_shared_claim():
    objects = load()
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    claim = objects["PersistentVolumeClaim"]
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod, on every node, mounts it
    for name in ("preflight", "trainer"):
        mounts = {m["mountPath"]: (m["name"], m.get("subPath")) for m in container(objects, name)["volumeMounts"]}
        assert mounts == {"/dev/shm": ("shm", None), "/app/runs": ("shared", "runs"), "/app/data": ("shared", "data")}, name


def test_preflight_runs_first_on_its_node_alone(monkeypatch):
    """The preflight experiment (experiments/preflight.py) runs before anything waits for another node:
    a world of its own on this pod's GPUs, in a run directory of its own."""
    objects = load()
    names = [c["name"] for c in pod_spec(objects)["initContainers"]]
    assert names == ["preflight", "wait-for-node-0"]
    preflight, trainer = container(objects, "preflight"), container(objects, "trainer")
    assert preflight["image"] == trainer["image"] == container(objects, "wait-for-node-0")["image"]
    env = environment(preflight, 1, pod_name="ddp-lab-1-q9w8e")
    assert env["RUN_DIR"] == "runs/preflight/ddp-lab-1-q9w8e"  # two pods never share a run directory
    monkeypatch.setattr(entrypoint, "_is_experiment", lambda name: name == "preflight")  # may not exist yet
    command = entrypoint.torchrun_command(env, [])
    assert "--standalone" in command and f"--nproc-per-node={gpus(preflight)}" in command
    assert command[-2:] == ["-m", "experiments.preflight"]


def test_the_entrypoint_turns_each_pods_environment_into_one_c10d_job(monkeypatch):
    """The trainer's variables, as pod 0 and pod 1 get them, through the image's own entrypoint."""
    objects = load()
    monkeypatch.setattr(entrypoint, "check_resolves", lambda *args: None)  # no cluster DNS here
    trainer = container(objects, "trainer")
    commands = [entrypoint.torchrun_command(environment(trainer, index), trainer["args"]) for index in (0, 1)]
    assert commands[0] == commands[1]  # c10d: every pod's agent runs the same command
    nodes, node0 = objects["Job"]["spec"]["parallelism"], environment(trainer, 0)["MASTER_ADDR"]
    for expected in (f"--nnodes={nodes}", f"--nproc-per-node={gpus(trainer)}", "--rdzv-backend=c10d", f"--rdzv-endpoint={node0}:29500"):
        assert expected in commands[0], expected
    assert commands[0][-2:] == ["-m", "experiments.toy"]
    # `kubectl delete` waits longer than torchrun gives the workers to checkpoint
    env = environment(trainer, 0)
    assert pod_spec(objects)["terminationGracePeriodSeconds"] > int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith("/app/runs/")  # flight-recorder dumps land on the claim


def test_scaling_with_the_documented_sed_changes_every_marked_line(tmp_path):
    text = JOB_YAML.read_text()
    assert len(re.findall(r"# NODES\n", text)) == 3 and len(re.findall(r"# GPUS\n", text)) == 4
    (line,) = [line for line in text.splitlines() if line.startswith("#   sed -i -E ")]
    copy_path = tmp_path / "job.yaml"
    copy_path.write_text(text)
    command = line[len("#   ") :].replace("docker/k8s/job.yaml", str(copy_path))
    subprocess.run(["bash", "-c", command], check=True)
    nodes, per_node = (int(n) for n in re.findall(r"s/\[0-9\]\+/(\d+)/", command))
    assert (nodes, per_node) != (2, 8)  # the example really changes both
    objects = load(copy_path.read_text())
    assert objects["Job"]["spec"]["parallelism"] == objects["Job"]["spec"]["completions"] == nodes
    assert environment(container(objects, "trainer"), 0)["NNODES"] == str(nodes)
    for name in ("preflight", "trainer"):
        assert gpus(container(objects, name)) == int(environment(container(objects, name), 0)["NPROC_PER_NODE"]) == per_node
    kubernetes_validate.validate(objects["Job"], KUBERNETES_VERSIONS[-1], strict=True)


def _wait(env: dict[str, str]) -> subprocess.CompletedProcess:
    script = container(load(), "wait-for-node-0")["args"][0]
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_the_wait_for_node_0_returns_once_the_port_answers_and_fails_with_one_line_when_it_never_does():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        answered = _wait({"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WAIT_S": "30"})
    assert answered.returncode == 0 and "answers" in answered.stdout, answered.stderr
    # the same port, closed now: past the deadline, one line naming node 0 and the exit is not 0
    closed = _wait({"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WAIT_S": "0"})
    assert closed.returncode != 0 and closed.stderr.startswith("error: node 0 (127.0.0.1:") and closed.stderr.count("\n") == 1
    # pod 0 hosts the rendezvous itself: it waits only until its own name resolves
    resolved = _wait({"NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": port, "WAIT_S": "0"})
    assert resolved.returncode == 0 and "resolves" in resolved.stdout, resolved.stderr
    unresolved = _wait({"NODE_RANK": "0", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": port, "WAIT_S": "0"})
    assert unresolved.returncode != 0 and "not reachable" in unresolved.stderr
