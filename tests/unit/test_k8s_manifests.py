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
# An older Kubernetes that has everything used here (Indexed Jobs that name their pods for a
# subdomain, the job-completion-index annotation), and the newest the package knows.
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


def environment(item: dict, index: int, objects: dict[str, dict]) -> dict[str, str]:
    """The container's variables as the kubelet sets them in pod `index`: the ConfigMap (envFrom), then
    the container's own `env` over it (the pod's index through the downward API)."""
    resolved: dict[str, str] = {}
    for source in item.get("envFrom", []):
        assert source["configMapRef"]["name"] == objects["ConfigMap"]["metadata"]["name"]
        resolved.update(objects["ConfigMap"]["data"])
    for variable in item.get("env", []):
        if "value" in variable:
            value = variable["value"]
        else:
            assert variable["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION, variable
            value = str(index)
        resolved[variable["name"]] = value
    assert all(isinstance(v, str) for v in resolved.values()), resolved  # the API takes strings only
    return resolved


def gpus(item: dict) -> int:
    return int(item["resources"]["limits"]["nvidia.com/gpu"])


def test_every_object_validates_against_the_kubernetes_schemas_offline():
    objects = load()
    assert set(objects) == {"PersistentVolumeClaim", "Service", "NetworkPolicy", "ConfigMap", "Job"}
    for version in KUBERNETES_VERSIONS:
        for item in objects.values():
            kubernetes_validate.validate(item, version, strict=True)  # strict: unknown fields are errors
    # the validator is not a rubber stamp: a misspelt field and a number where a string belongs fail
    misspelt = copy.deepcopy(objects["Job"])
    pod_spec({"Job": misspelt})["volumes"][0]["emptyDir"]["medum"] = "Memory"
    unquoted = copy.deepcopy(objects["Job"])
    container({"Job": unquoted}, "trainer")["env"][1]["value"] = 29500
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
    for name in ("wait-for-node-0", "preflight", "trainer"):
        nnodes = int(environment(container(objects, name), 0, objects)["NNODES"])
        assert job["parallelism"] == job["completions"] == nnodes > 1, name
    # a failed pod fails the job at once (the others are stopped), as srun --kill-on-bad-exit does
    assert job["backoffLimit"] == 0 and pod_spec(objects)["restartPolicy"] == "Never"


def test_gpu_limit_equals_the_processes_per_pod():
    objects = load()
    for name in ("preflight", "trainer"):
        item = container(objects, name)
        assert gpus(item) == int(environment(item, 0, objects)["NPROC_PER_NODE"]) > 0, name
    assert "resources" not in container(objects, "wait-for-node-0")  # a socket probe needs no GPU


def test_master_addr_is_pod_0_through_the_headless_service():
    objects = load()
    service, job, spec = objects["Service"], objects["Job"], pod_spec(objects)
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    # pod 0's name must resolve while its init containers run, before the pod is Ready
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()  # the service selects the job's pods
    assert spec["subdomain"] == service["metadata"]["name"]  # which names pod i <job>-i.<service>
    node0 = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    service_ports = {p["port"] for p in service["spec"]["ports"]} | {p["targetPort"] for p in service["spec"]["ports"]}
    for name in ("wait-for-node-0", "preflight", "trainer"):
        for index in (0, 1):
            env = environment(container(objects, name), index, objects)
            assert (env["MASTER_ADDR"], env["NODE_RANK"], env["RDZV_BACKEND"]) == (node0, str(index), "c10d"), name
            assert int(env["MASTER_PORT"]) in service_ports, name
    for name in ("preflight", "trainer"):  # the agent on pod 0 listens on the port it declares
        item = container(objects, name)
        assert [p["containerPort"] for p in item["ports"]] == [int(environment(item, 0, objects)["MASTER_PORT"])], name
    # Kubernetes' Service variables stay out: a Service named "master" would set MASTER_PORT=tcp://...
    assert spec["enableServiceLinks"] is False
    # only the job's own pods reach its ports
    policy = objects["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert [source["podSelector"]["matchLabels"] for source in policy["ingress"][0]["from"]] == [
        policy["podSelector"]["matchLabels"]
    ]


def test_shm_is_memory_backed_and_runs_are_on_the_shared_claim():
    objects = load()
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    claim = objects["PersistentVolumeClaim"]
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod, on every node, mounts it
    for name in ("preflight", "trainer"):
        mounts = {m["mountPath"]: (m["name"], m.get("subPath")) for m in container(objects, name)["volumeMounts"]}
        assert mounts == {
            "/dev/shm": ("shm", None),
            "/app/runs": ("shared", "runs"),
            "/app/data": ("shared", "data"),
        }, name


def test_preflight_checks_the_whole_job_first_apart_from_the_run(monkeypatch):
    """The preflight (EXPERIMENT=preflight: tools/preflight/) runs like the job it prepares (same nodes, GPUs,
    variables), after the wait and before the trainer, on a port and rendezvous id of its own: a trainer that
    starts while pod 0's preflight is still finishing cannot join the preflight's rendezvous."""
    objects = load()
    assert [c["name"] for c in pod_spec(objects)["initContainers"]] == ["wait-for-node-0", "preflight"]
    wait, preflight, trainer = (container(objects, name) for name in ("wait-for-node-0", "preflight", "trainer"))
    assert wait["image"] == preflight["image"] == trainer["image"]
    monkeypatch.setattr(entrypoint, "check_resolves", lambda *args: None)  # no cluster DNS here
    env = {
        name: environment(container(objects, name), 1, objects) for name in ("wait-for-node-0", "preflight", "trainer")
    }
    assert env["wait-for-node-0"]["MASTER_PORT"] == env["preflight"]["MASTER_PORT"] != env["trainer"]["MASTER_PORT"]
    assert env["preflight"]["RDZV_ID"] != env["trainer"]["RDZV_ID"]
    shared = {k: v for k, v in env["trainer"].items() if k not in ("EXPERIMENT", "MASTER_PORT", "RDZV_ID")}
    assert {k: env["preflight"].get(k) for k in shared} == shared  # otherwise the same job
    command = entrypoint.torchrun_command(env["preflight"], preflight["args"])
    assert f"--rdzv-endpoint={env['preflight']['MASTER_ADDR']}:{env['preflight']['MASTER_PORT']}" in command
    assert (
        f"--nnodes={objects['Job']['spec']['parallelism']}" in command
        and f"--nproc-per-node={gpus(preflight)}" in command
    )
    assert command[-2:] == ["-m", "experiments.preflight"]


def test_the_entrypoint_turns_each_pods_environment_into_one_c10d_job(monkeypatch):
    """The trainer's variables, as pod 0 and pod 1 get them, through the image's own entrypoint."""
    objects = load()
    monkeypatch.setattr(entrypoint, "check_resolves", lambda *args: None)  # no cluster DNS here
    trainer = container(objects, "trainer")
    commands = [entrypoint.torchrun_command(environment(trainer, index, objects), trainer["args"]) for index in (0, 1)]
    assert commands[0] == commands[1]  # c10d: every pod's agent runs the same command
    env = environment(trainer, 0, objects)
    nodes = objects["Job"]["spec"]["parallelism"]
    for expected in (
        f"--nnodes={nodes}",
        f"--nproc-per-node={gpus(trainer)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={env['MASTER_ADDR']}:29500",
        "--rdzv-id=ddp-lab",
    ):
        assert expected in commands[0], expected
    assert commands[0][-2:] == ["-m", "experiments.toy"]
    # `kubectl delete` waits longer than torchrun gives the workers to checkpoint
    assert pod_spec(objects)["terminationGracePeriodSeconds"] > int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    # Flight-recorder dumps go to the run directory, which is under runs/ (the claim): no prefix elsewhere.
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env and "RUN_DIR" not in env


def test_scaling_with_the_documented_sed_changes_every_marked_line(tmp_path):
    text = JOB_YAML.read_text()
    assert len(re.findall(r"# NODES\n", text)) == 3 and len(re.findall(r"# GPUS\n", text)) == 3
    (line,) = [line for line in text.splitlines() if line.startswith("#   sed -i -E ")]
    copy_path = tmp_path / "job.yaml"
    copy_path.write_text(text)
    command = line[len("#   ") :].replace("docker/k8s/job.yaml", str(copy_path))
    subprocess.run(["bash", "-c", command], check=True)
    nodes, per_node = (int(n) for n in re.findall(r"s/\[0-9\]\+/(\d+)/", command))
    assert (nodes, per_node) != (2, 8)  # the example really changes both
    objects = load(copy_path.read_text())
    assert objects["Job"]["spec"]["parallelism"] == objects["Job"]["spec"]["completions"] == nodes
    for name in ("preflight", "trainer"):
        env = environment(container(objects, name), 0, objects)
        assert env["NNODES"] == str(nodes) and gpus(container(objects, name)) == int(env["NPROC_PER_NODE"]) == per_node
    for item in objects.values():
        kubernetes_validate.validate(item, KUBERNETES_VERSIONS[-1], strict=True)


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
    assert (
        closed.returncode != 0
        and closed.stderr.startswith("error: node 0 (127.0.0.1:")
        and closed.stderr.count("\n") == 1
    )
    # pod 0 hosts the rendezvous itself: it waits only until its own name resolves
    resolved = _wait({"NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": port, "WAIT_S": "0"})
    assert resolved.returncode == 0 and "resolves" in resolved.stdout, resolved.stderr
    unresolved = _wait({"NODE_RANK": "0", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": port, "WAIT_S": "0"})
    assert unresolved.returncode != 0 and "not reachable" in unresolved.stderr
