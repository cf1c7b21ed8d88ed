"""The layers the code keeps, read from its import statements (ast, nothing imported) and its string literals.

- the top-level packages import one way, lazy imports in functions included: bench and tools may import experiments
  and ddp_core, experiments only ddp_core, ddp_core none of them, and none of them tests;
- no circle of imports between modules, inside a package too, lazy imports and ``TYPE_CHECKING`` ones included;
- inside ddp_core each package imports only itself and the layers below it, as docs/design.md's "Layers" lists
  them (so no two packages import each other), lazy imports in functions included;
- no module imports a private name (a leading underscore) of another, and none reads one off another
  module (``module._name``). Tests may, of the code they test;
- the run directory's file names are written only in ddp_core/layout.py (tests and docs may spell them).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ddp_core import layout

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("ddp_core", "experiments", "bench", "tools", "tests")
CODE = ("ddp_core", "experiments", "bench", "tools")  # the code, as against its tests
LAYOUT = REPO / "ddp_core" / "layout.py"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the module imported (for ``from m import name``: m.name when that is a module, else m)
    base: str  # ``from m import name``'s m
    name: str | None  # ``from m import name``'s name
    bound: str  # the name the statement binds in the module
    line: int
    module_level: bool  # not inside a function: runs when the module is imported

    def __str__(self) -> str:
        what = f"from {self.base} import {self.name}" if self.name else f"import {self.target}"
        return f"{self.source}:{self.line}: {what}"


@cache
def modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _nodes(tree: ast.AST) -> list[tuple[ast.AST, bool]]:
    """Every node with whether it runs at import time (outside any function body)."""
    out = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            out.append((child, inside))
            visit(child, inside)

    visit(tree, True)
    return out


@cache
def parsed(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text(), str(modules()[module]))


def imports_of(module: str, source: str | None = None) -> list[Import]:
    """``module``'s import statements; ``source`` stands in for its file's text (the tests below)."""
    tree = ast.parse(source) if source is not None else parsed(module)
    is_package = source is None and modules()[module].name == "__init__.py"
    found = []
    for node, module_level in _nodes(tree):
        if isinstance(node, ast.Import):
            found += [
                Import(module, alias.name, alias.name, None, alias.asname or top(alias.name), node.lineno, module_level)
                for alias in node.names
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base
                found.append(
                    Import(module, target, base, alias.name, alias.asname or alias.name, node.lineno, module_level)
                )
    return found


def all_imports() -> list[Import]:
    return [found for module in sorted(modules()) for found in imports_of(module)]


def top(name: str) -> str:
    return name.split(".")[0]


# --- ddp_core's layers: docs/design.md is where they are stated ---------------------------------------------------


def layers() -> dict[str, int]:
    """``{package: layer}`` from docs/design.md's "Layers" block (the first line is the top layer)."""
    text = (REPO / "docs" / "design.md").read_text()
    block = re.search(r"## Layers\n.*?```text\n(.*?)```", text, re.S)
    assert block, "docs/design.md has no '## Layers' section with a ```text block"
    rows = [line.split("|")[0].split() for line in block.group(1).splitlines() if line.strip()]
    return {name: len(rows) - index for index, names in enumerate(rows) for name in names}


def package(module: str) -> str:
    """ddp_core's package of ``module``: its subpackage or top-level module."""
    parts = module.split(".")[1:]
    return parts[0] if parts else "ddp_core"


def layer_violations(found: list[Import], layer: dict[str, int]) -> list[str]:
    problems = []
    for imported in found:
        if top(imported.source) != "ddp_core" or top(imported.target) != "ddp_core":
            continue
        source, target = package(imported.source), package(imported.target)
        if source == target or target == "ddp_core":
            continue
        for name in (source, target):
            if name not in layer:
                problems.append(f"{imported}: ddp_core.{name} is in no layer of docs/design.md's 'Layers'")
        if source in layer and target in layer and layer[target] >= layer[source]:
            problems.append(
                f"{imported}: {source} (layer {layer[source]}) may not import {target} (layer {layer[target]})"
            )
    return problems


def test_ddp_core_imports_only_the_layers_below_each_package():
    assert layer_violations(all_imports(), layers()) == []


def test_a_package_importing_one_above_it_or_beside_it_is_caught():
    layer = {"errors": 1, "output": 5, "layout": 0, "process": 6, "training": 4, "data": 4}
    found = [
        *imports_of("ddp_core.output.run", "from ddp_core.process import heartbeat"),
        *imports_of("ddp_core.training.seed", "def f():\n    from ddp_core.data import x"),
        *imports_of("ddp_core.errors", "from ddp_core.layout import METRICS"),
        *imports_of("ddp_core.layout", "def f():\n    from ddp_core.errors import ConfigError"),
        *imports_of("ddp_core.process.exit", "from ddp_core.output.run import record_exit"),
        *imports_of("ddp_core.new_thing", "from ddp_core.errors import ConfigError"),
    ]
    assert layer_violations(found, layer) == [
        "ddp_core.output.run:1: from ddp_core.process import heartbeat: output (layer 5) may not import process "
        "(layer 6)",
        "ddp_core.training.seed:2: from ddp_core.data import x: training (layer 4) may not import data (layer 4)",
        "ddp_core.layout:2: from ddp_core.errors import ConfigError: layout (layer 0) may not import errors (layer 1)",
        "ddp_core.new_thing:1: from ddp_core.errors import ConfigError: ddp_core.new_thing is in no layer of "
        "docs/design.md's 'Layers'",
    ]


# --- the way the top-level folders import each other --------------------------------------------------------------


# What each top-level package may import of the others (itself aside): the one way they flow, lazy imports included.
MAY_IMPORT = {
    "bench": {"experiments", "ddp_core"},
    "tools": {"experiments", "ddp_core"},
    "experiments": {"ddp_core"},
    "ddp_core": set(),
}


def direction_violations(found: list[Import]) -> list[str]:
    problems = []
    for imported in found:
        source, target = top(imported.source), top(imported.target)
        if source in MAY_IMPORT and target in ROOTS and target != source and target not in MAY_IMPORT[source]:
            problems.append(f"{imported}: {source} may not import {target}")
    return problems


def test_the_top_level_packages_import_one_way():
    assert direction_violations(all_imports()) == []


def test_an_import_against_the_direction_is_caught():
    found = [
        *imports_of("ddp_core.runs", "import experiments.toy"),
        *imports_of("ddp_core.runs", "def f():\n    import experiments.toy"),  # lazy: caught too
        *imports_of("bench.missing_node", "from tests.hosts import netns"),
        *imports_of("tools.commbench", "def f():\n    from tests import prefork"),
        *imports_of("experiments.preflight", "from tools.preflight.main import main"),
        *imports_of("bench.comm", "from tools.commbench import main"),
        *imports_of("tools.preflight.probes", "def f():\n    from experiments import cifar10_data"),  # allowed
        *imports_of("bench.ddp", "from experiments import toy\nfrom ddp_core.ranks import on_rank0"),  # allowed
        *imports_of("tests.unit.test_x", "import tools.commbench\nimport bench.ddp"),  # tests may import anything
    ]
    assert direction_violations(found) == [
        "ddp_core.runs:1: import experiments.toy: ddp_core may not import experiments",
        "ddp_core.runs:2: import experiments.toy: ddp_core may not import experiments",
        "bench.missing_node:1: from tests.hosts import netns: bench may not import tests",
        "tools.commbench:2: from tests import prefork: tools may not import tests",
        "experiments.preflight:1: from tools.preflight.main import main: experiments may not import tools",
        "bench.comm:1: from tools.commbench import main: bench may not import tools",
    ]


# --- circles ------------------------------------------------------------------------------------------------------

# Circles being broken elsewhere; none may be added. Each: its modules, sorted.
KNOWN_CYCLES: list[list[str]] = []


def cycles(found: list[Import]) -> list[list[str]]:
    """The modules that import each other in a circle (strongly connected, Tarjan's), each group sorted; lazy and
    ``TYPE_CHECKING`` imports count: a circle is one whatever runs when."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imported in found:
        if imported.source != imported.target and top(imported.target) in ROOTS:
            graph[imported.source].add(imported.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(groups)


def test_no_modules_import_each_other_in_a_circle():
    code = [imported for imported in all_imports() if top(imported.source) in CODE]
    assert cycles(code) == KNOWN_CYCLES


def test_a_circle_is_caught_lazy_or_not():
    found = [
        *imports_of("ddp_core.lifecycle.loop", "from ddp_core.lifecycle.plan import Plan"),
        *imports_of("ddp_core.lifecycle.plan", "def f():\n    from ddp_core.lifecycle.loop import TrainingLoop"),
        *imports_of("tools.study", "def run():\n    from tools.study.local import run_local"),
        *imports_of("tools.study.local", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tools.study"),
        *imports_of("tools.study.k8s", "from tools.study.local import Ending"),  # one way: no circle
        *imports_of("ddp_core.runs", "from ddp_core.layout import METRICS"),
    ]
    assert cycles(found) == [
        ["ddp_core.lifecycle.loop", "ddp_core.lifecycle.plan"],
        ["tools.study", "tools.study.local"],
    ]


# --- private names ------------------------------------------------------------------------------------------------


def private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def private_uses(module: str, source: str | None = None) -> list[str]:
    """``from m import _x`` and ``m._x`` in ``module``, m being another module of the project."""
    tree = ast.parse(source) if source is not None else parsed(module)
    found, aliases = [], {}
    for imported in imports_of(module, source):
        if top(imported.target) not in ROOTS or imported.target == module:
            continue
        if imported.name is None or imported.target.endswith(f".{imported.name}"):
            aliases[imported.bound] = imported.target  # a module, under the name it is bound to
        elif private(imported.name):
            found.append(f"{imported}: a private name of another module")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain = node.value
            while isinstance(chain, ast.Attribute):
                chain = chain.value
            if isinstance(chain, ast.Name) and chain.id in aliases:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}: a private name of another module")
    return found


def test_no_module_uses_a_private_name_of_another():
    assert [use for module in sorted(modules()) if top(module) in CODE for use in private_uses(module)] == []


def test_a_private_name_from_another_module_is_caught():
    source = (
        "from ddp_core.runs import _table, read_run\n"
        "from experiments import cifar10_data as data\n"
        "import ddp_core.config\n"
        "data._how_to_get_it('x')\n"
        "ddp_core.config._plain_type(int)\n"
        "data.load_split('x')\n"
    )
    assert private_uses("experiments.cifar10", source) == [
        "experiments.cifar10:1: from ddp_core.runs import _table: a private name of another module",
        "experiments.cifar10:4: data._how_to_get_it: a private name of another module",
        "experiments.cifar10:5: ddp_core.config._plain_type: a private name of another module",
    ]


# --- the run directory's names ------------------------------------------------------------------------------------

NAMES = {layout.MANIFEST, layout.METRICS, layout.CHECKPOINTS, layout.LAST, layout.STEP_GLOB}
PREFIXES = (layout.EVENTS.rstrip("*"), layout.FLIGHT_RECORDER, layout.failure_report_name(0).split("0")[0])
PATH_LIKE = re.compile(r"[\w.*{}/-]+")  # a file name or path; not a message or a docstring that mentions one


def spelled_names(text: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and PATH_LIKE.fullmatch(node.value):
            parts = node.value.split("/")
            if any(part in NAMES or part.startswith(PREFIXES) for part in parts):
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    return found


def test_the_run_directorys_names_are_spelled_only_in_layout():
    found = [
        use
        for module, path in sorted(modules().items())
        if top(module) in CODE and path != LAYOUT
        for use in spelled_names(path.read_text(), module)
    ]
    assert found == [], "use ddp_core.layout's names"


def test_a_spelled_name_is_caught_and_a_sentence_that_mentions_one_is_not():
    source = (
        "a = run_dir / 'metrics.json'\n"
        "b = f'{run}/checkpoints/last.pt'\n"
        "c = sorted(folder.glob('events.out.tfevents.*'))\n"
        "d = run_dir / f'failure_node{rank}.txt'\n"
        "raise ValueError('no metrics.json: the run has not ended')\n"
        "'''A docstring about manifest.json.'''\n"
    )
    assert spelled_names(source, "m") == [
        "m:1: 'metrics.json'",
        "m:2: '/checkpoints/last.pt'",
        "m:3: 'events.out.tfevents.*'",
        "m:4: 'failure_node'",
    ]
