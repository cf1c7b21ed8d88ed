"""Every message that all ranks would print is printed once, at 2, 3 and 4 processes on one node and on two nodes.

One table: each message kind, the launch that makes it, and who prints it (ddp_core/output/logging.py states the
rule): once per job (global rank 0), once per node (its local rank 0: a bad flag, which every process of a node
reads alike), or once per rank (a warning about that rank alone). Five launches per world, through ddp-lab's own
launcher, each feeding several rows: a bad flag; the spawn flag --nproc under the launcher; a run that a SIGTERM
to its last rank stops after step 3 (with tests/e2e/warning_probe.py's two warnings); its resume, stopped as
asked at step 6; and a resume refused for another seed. The two nodes are two agents on this host (static
rendezvous), each with its own output.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

import pytest

from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE, STOPPED_EXIT_CODE
from ddp_core.process.launch import free_port
from tests.e2e.launch import REPO, clean_env, torchrun_command
from tests.e2e.warning_probe import ALIKE, OWN


@dataclass(frozen=True)
class World:
    nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


WORLDS = {"2": World(1, 2), "3": World(1, 3), "4": World(1, 4), "2x2-nodes": World(2, 2)}
TOY = ("--steps", "40", "--dataset-size", "256")

ONCE, EACH_NODE, EACH_RANK = "once per job", "once per node", "once per rank"
MESSAGES = [  # (kind, launch, the line, who prints it)
    ("bad-flag", "bad_flag", r"^error: --lr=-1 is out of range", EACH_NODE),
    ("nproc-under-a-launcher", "nproc", r"^error: --nproc=2 starts processes itself", EACH_NODE),
    ("refusal", "refused", r"^error: .*--seed: 0 -> 7", ONCE),
    ("stopped-by-a-signal", "stopped", r"\] WARNING stopped by a signal after step 3; to continue", ONCE),
    ("stopped-as-asked", "resumed", r"\] WARNING stopped as asked at step 6 of 40;", ONCE),
    ("warning-alike", "stopped", rf"\] WARNING {re.escape(ALIKE)}$", ONCE),
    ("warning-own", "stopped", r"\] WARNING " + re.escape(OWN).replace(r"\{rank\}", r"\d+") + "$", EACH_RANK),
]
EXIT_CODES = {
    "bad_flag": CONFIG_ERROR_EXIT_CODE,
    "nproc": CONFIG_ERROR_EXIT_CODE,
    "stopped": STOPPED_EXIT_CODE,
    "resumed": 0,
    "refused": CONFIG_ERROR_EXIT_CODE,
}


def launch(world: World, *args: str, **env: str) -> list[tuple[int, str]]:
    """One job of ``world``: each node's launcher (ddp_core.torchrun), its exit code and output (stdout and stderr)."""
    port = free_port()
    agents = []
    try:
        for node in range(world.nodes):
            rendezvous = (
                ("--standalone",)
                if world.nodes == 1
                else (
                    f"--nnodes={world.nodes}",
                    f"--node-rank={node}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                )
            )
            command = torchrun_command(world.per_node, *args, torchrun_args=rendezvous, launcher="ddp_core.torchrun")
            agents.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=clean_env(**env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return [(agent.returncode, output) for agent, output in zip(agents, outputs)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    """The four launches of a world, made once on first use: {launch: [(exit code, output) per node]}."""
    made: dict[str, dict[str, list[tuple[int, str]]]] = {}

    def of(name: str) -> dict[str, list[tuple[int, str]]]:
        if name not in made:
            world = WORLDS[name]
            run_dir = str(tmp_path_factory.mktemp(f"world-{name}") / "run")
            last_rank = str(world.size - 1)
            made[name] = {
                "bad_flag": launch(world, "experiments.toy", "--lr", "-1"),
                # Also the launcher's: the experiment's --nproc after the script is not taken as torchrun's
                # --nproc-per-node abbreviated (argparse's "ambiguous option", before any worker started).
                "nproc": launch(world, "experiments.toy", "--nproc", "2"),
                "stopped": launch(
                    world,
                    "tests.e2e.faulty",
                    "tests.e2e.warning_probe",
                    "experiments.toy",
                    "--run-dir",
                    run_dir,
                    *TOY,
                    FAULT="sigterm",
                    FAULT_RANK=last_rank,
                    FAULT_STEP="3",
                ),
                "resumed": launch(
                    world, "experiments.toy", "--run-dir", run_dir, *TOY, "--resume", "--stop-at-step", "6"
                ),
                "refused": launch(world, "experiments.toy", "--run-dir", run_dir, *TOY, "--resume", "--seed", "7"),
            }
        return made[name]

    return of


def shown(output: str) -> str:
    return output[-4000:]


@pytest.mark.parametrize("world", WORLDS)
def test_every_launch_ends_with_its_code(jobs, world: str):
    for name, nodes in jobs(world).items():
        for node, (code, output) in enumerate(nodes):
            assert code == EXIT_CODES[name], f"{name}, node {node}: exit {code}\n{shown(output)}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("kind", "launch_name", "line", "who"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_a_message_every_rank_would_print_is_printed_once(jobs, world: str, kind, launch_name, line, who):
    w = WORLDS[world]
    pattern = re.compile(line)
    per_node = [
        [text for text in output.splitlines() if pattern.search(text)] for _, output in jobs(world)[launch_name]
    ]
    expected = {
        ONCE: [1] + [0] * (w.nodes - 1),  # global rank 0 is on node 0 (static rendezvous)
        EACH_NODE: [1] * w.nodes,
        EACH_RANK: [w.per_node] * w.nodes,
    }[who]
    assert [len(lines) for lines in per_node] == expected, "\n\n".join(
        shown(output) for _, output in jobs(world)[launch_name]
    )
    if who == EACH_RANK:  # each rank's own line, on its own node
        for node, lines in enumerate(per_node):
            ranks = sorted(int(re.search(r"\[rank (\d+)/", text).group(1)) for text in lines)
            assert ranks == list(range(node * w.per_node, (node + 1) * w.per_node)), lines


@pytest.mark.parametrize("world", WORLDS)
def test_the_other_ranks_print_only_their_own_lines(jobs, world: str):
    """Beyond the table: no log line of any other kind comes from a rank but 0."""
    own = re.compile(r"\] WARNING " + re.escape(OWN).replace(r"\{rank\}", r"\d+") + "$")
    for name, nodes in jobs(world).items():
        for _, output in nodes:
            others = [line for line in output.splitlines() if re.search(r"\[rank [1-9]\d*/\d+\]", line)]
            assert all(own.search(line) for line in others), f"{name}: {others}"
