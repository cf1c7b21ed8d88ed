"""``--heal``'s launcher side without launching: the flag is the launcher's, its refusals are one line and exit 2
before anything starts, and the launch it makes (tests/e2e/test_heal_launch.py launches it for real)."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

from ddp_core import torchrun
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE, FINISHED_EXIT_CODES, STOPPED_EXIT_CODE
from ddp_core.process import heal

NOT_PYTHON = "--heal runs each worker under python, its client's child: drop --no-python, --numa-binding"
SCRIPT = ["-m", "experiments.toy", "--steps", "3"]


@pytest.mark.parametrize(
    ("argv", "healing", "script", "script_args"),
    [
        (["--heal", "--nproc-per-node=2", "-m", "toy", "--lr", "1"], "1", "toy", ["--lr", "1"]),
        (["--heal", "--nproc-per-node", "3", "train.py"], "1", "train.py", []),
        (["-m", "toy", "--heal"], None, "toy", ["--heal"]),  # the script's own flag
        (["-m", "toy"], None, "toy", []),
    ],
)
def test_heal_is_taken_from_torchruns_options_only(monkeypatch, tmp_path, argv, healing, script, script_args):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv(heal.VARIABLE, "1")  # inherited from a worker that started this launcher: not its own
    seen = {}
    monkeypatch.setattr(torchrun, "run", lambda launch: seen.update(launch=launch, heal=os.environ.get(heal.VARIABLE)))
    torchrun.main(["--standalone", "--max-restarts=1", *argv])
    launch = seen["launch"]
    assert (seen["heal"], launch.training_script, launch.training_script_args) == (healing, script, script_args)


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        ([], "--heal replaces a dead worker from --max-restarts: give --max-restarts=N, N > 0"),
        (["--max-restarts=0"], "--heal replaces a dead worker from --max-restarts: give --max-restarts=N, N > 0"),
        (["--max-restarts=1", "--nnodes=1:2"], "--heal keeps the world's size: give --nnodes one number, not 1:2"),
        (["--max-restarts=1", "--nproc-per-node=1"], "--heal heals from a peer: run 2 or more processes"),
        (["--max-restarts=1", "--no-python"], NOT_PYTHON),
        (["--max-restarts=1", "--numa-binding=node"], NOT_PYTHON),
        (["--max-restarts=1", "no torchft"], "--heal needs torchft: pip install -r requirements-heal.txt"),
    ],
)
def test_a_launch_heal_cannot_serve_is_one_line_and_exit_2_before_anything_starts(
    monkeypatch, capsys, tmp_path, flags, refusal
):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    if "no torchft" in flags:
        flags = flags[:-1]
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torchft" else find_spec(name))
    monkeypatch.setattr(torchrun, "run", lambda launch: pytest.fail("a refused launch ran"))
    with pytest.raises(SystemExit) as exit:
        torchrun.main(["--standalone", "--heal", "--nproc-per-node=3", *flags, *SCRIPT])
    assert exit.value.code == CONFIG_ERROR_EXIT_CODE
    assert capsys.readouterr().err.splitlines() == [f"error: {refusal}"]
    assert list(tmp_path.iterdir()) == [] and heal.VARIABLE not in os.environ


def test_under_heal_torch_never_restarts_the_group_and_the_workers_get_the_heal_variables(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    seen = {}

    def run(launch):
        seen.update(restarts=launch.max_restarts, env={name: os.environ.get(name) for name in heal.VARIABLES})
        seen.update(budget=heal.budget(), rust=os.environ.get("RUST_LOG"))

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.delenv("RUST_LOG", raising=False)
    torchrun.main(["--standalone", "--heal", "--max-restarts=2", "--nproc-per-node=3", *SCRIPT])
    assert seen["restarts"] == 0 and seen["budget"] == 2 and seen["rust"] == "warn"
    assert seen["env"] == {
        heal.VARIABLE: "1",
        heal.LIGHTHOUSE_VARIABLE: None,
        heal.BUDGET_VARIABLE: "2",
        heal.REPLACEMENT_VARIABLE: None,
    }
    assert all(name not in os.environ for name in heal.VARIABLES)  # one launch's


def test_the_codes_a_client_does_not_replace_are_the_launchers_stated_ones():
    assert FINISHED_EXIT_CODES == {0, STOPPED_EXIT_CODE, *torchrun.STATED_EXIT_CODES}


class Store(dict):
    def set(self, key: str, value: bytes) -> None:
        self[key] = value

    def get(self, key: str) -> bytes:
        return self[key]


@pytest.mark.parametrize(
    ("local_addr", "address"),
    [(None, "http://127.0.0.1:4321"), ("10.0.0.7", "http://10.0.0.7:4321"), ("fd00::7", "http://[fd00::7]:4321")],
)
def test_the_lighthouse_is_published_where_other_hosts_reach_it_not_under_its_host_name(
    monkeypatch, local_addr, address
):
    store, lighthouse = Store(), SimpleNamespace(address=lambda: "http://this-host-name:4321")

    def group(rank: int) -> SimpleNamespace:
        spec = SimpleNamespace(local_world_size=3, local_addr=local_addr)
        return SimpleNamespace(
            group_rank=rank, group_world_size=2, spec=spec, store=store, master_addr="127.0.0.1", master_port=29500
        )

    monkeypatch.delenv(heal.LIGHTHOUSE_VARIABLE, raising=False)
    assert heal.meet_at_the_lighthouse(group(0), lighthouse) is lighthouse  # kept: started once per agent
    assert store[heal.LIGHTHOUSE_KEY] == address.encode() and os.environ[heal.LIGHTHOUSE_VARIABLE] == address
    monkeypatch.delenv(heal.LIGHTHOUSE_VARIABLE)
    assert heal.meet_at_the_lighthouse(group(1), None) is None  # another node's agent: it reads the address
    assert os.environ[heal.LIGHTHOUSE_VARIABLE] == address
