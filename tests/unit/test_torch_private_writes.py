"""No module writes a private attribute of torch's (a leading underscore): read from the code's syntax.

torch's private names change between releases without notice, and one written in place changes torch for the
whole process. Reading one is allowed (where it is the only source of a fact); writing, deleting and replacing
one is not. Caught, in ddp_core, experiments, bench, tools and tests:

- ``X._name = value``, ``X._name += value``, ``del X._name``, where ``X`` is torch's: a name imported from torch
  (a module, a class, a function), anything reached from one (``torch.a.b``), a name assigned from a call of one
  (``opt = ZeroRedundancyOptimizer(...)``), a parameter annotated with one (``self: LocalElasticAgent``), or a
  loop variable over a literal that holds one;
- the same on ``self`` in a method of a class derived from torch's (in this module, directly or through a class of
  the module), for a private name that torch's code of those classes uses: there our attributes and torch's share
  one namespace (``self._remaining_restarts`` in a subclass of LocalElasticAgent is torch's count);
- ``setattr``/``delattr``/``monkeypatch.setattr``/``object.__setattr__`` on such an ``X`` with a private name, or
  with a name it cannot read (not a constant, nor a loop variable over constants), and
  ``monkeypatch.setattr("torch.a._b", ...)``.

Not caught: a torch object reached through something it cannot trace (an attribute of one of ours, a function's
result, a parameter without an annotation, a class derived from torch's through another module's class).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache

from tests.unit.test_layers import ROOTS, modules

SETTERS = {"setattr", "delattr", "__setattr__", "__delattr__"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def root(node: ast.AST) -> str | None:
    """The name an expression starts from: ``torch`` in ``torch.a.b[0].c()``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_imports(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """``{name: its path in torch}`` for the names the imports of torch bind (``dist``: ``torch.distributed``), and
    the names assigned from a call of one of them anywhere in the module (``opt = ZeroRedundancyOptimizer(...)``)."""
    names, calls = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _torch(alias.name):
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and _torch(node.module or ""):
            names |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            calls.append(node)
    made = {t.id for node in calls if root(node.value) in names for t in node.targets if isinstance(t, ast.Name)}
    return names, made


def _torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def dotted(node: ast.AST, imported: dict[str, str]) -> str | None:
    """``torch.nn.Module`` for ``nn.Module`` after ``from torch import nn``; None for a name not from torch."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in imported:
        return None
    return ".".join([imported[node.id], *reversed(parts)])


@cache
def used_by_torch(path: str) -> frozenset[str] | None:
    """Every private name in the source of torch's class ``path`` and of its bases in torch; None where unknown.

    A class of ours derived from it shares its instances' attributes with torch's code: a private name of ours
    there is allowed where torch's classes never use it (a test's stand-in for another torch class's layout)."""
    parts, found = path.split("."), None
    for index in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:index]))
        except ImportError:
            continue
        for name in parts[index:]:
            found = getattr(found, name, None)
        break
    if not isinstance(found, type):
        return None
    names: set[str] = set()
    for cls in found.__mro__:
        if cls.__module__.split(".")[0] == "torch":
            try:
                names |= set(re.findall(r"\b_[A-Za-z]\w*", inspect.getsource(cls)))
            except (OSError, TypeError):
                return None
    return frozenset(names)


@dataclass(frozen=True)
class Scope:
    torch: frozenset[str]  # names that are torch's here
    strings: Mapping[str, frozenset[str]]  # names whose string values are known: loop variables, module constants
    derived: Mapping[str, frozenset[str] | None]  # a torch subclass's method's self: torch's private names there

    def is_torch(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return False
        return root(node) in self.torch

    def owns(self, node: ast.AST, name: str) -> bool:
        """Writing ``name`` on ``node`` writes a private attribute of torch's."""
        if not private(name):
            return False
        if self.is_torch(node):
            return True
        if isinstance(node, ast.Name) and node.id in self.derived:
            used = self.derived[node.id]
            return used is None or name in used
        return False


def private_writes(source: str, where: str) -> list[str]:
    if "torch" not in source:  # nothing of torch's to name, nor "torch.a._b" to patch
        return []
    tree = ast.parse(source)
    imported, made = torch_imports(tree)
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {ast.unparse(node)}: {what}")

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, (ast.Assign, ast.Delete)):
            listed = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            listed = [node.target]
        else:
            return []
        flat: list[ast.AST] = []
        while listed:
            target = listed.pop(0)
            if isinstance(target, (ast.Tuple, ast.List)):
                listed += target.elts
            else:
                flat.append(target.value if isinstance(target, ast.Starred) else target)
        return flat

    def check(node: ast.AST, scope: Scope) -> None:
        for target in targets(node):
            if isinstance(target, ast.Attribute) and scope.owns(target.value, target.attr):
                report(node, "writes a private attribute of torch's")
        if isinstance(node, ast.Call) and node.args:
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if called not in SETTERS:
                return
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):  # monkeypatch.setattr("a.b._c", v)
                if _torch(first.value) and private(first.value.rsplit(".", 1)[-1]):
                    report(node, "replaces a private attribute of torch's")
                return
            if len(node.args) < 2:
                return
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names: frozenset[str] | None = frozenset([name.value])
            else:
                names = scope.strings.get(name.id) if isinstance(name, ast.Name) else None
            if names is None and (scope.is_torch(first) or scope.owns(first, "_")):
                report(node, "sets an attribute of torch's by a name it cannot read")
            elif names is not None and any(scope.owns(first, each) for each in names):
                report(node, "replaces a private attribute of torch's")

    def loop(node: ast.For, scope: Scope) -> Scope:
        """``for a, b in ((X, "_x"), ...)``: a is torch's if any X is, b's values are the strings; over a constant."""
        if isinstance(node.iter, ast.Name) and isinstance(node.target, ast.Name) and node.iter.id in scope.strings:
            return replace(scope, strings={**scope.strings, node.target.id: scope.strings[node.iter.id]})
        if not isinstance(node.iter, (ast.Tuple, ast.List)):
            return scope
        rows = node.iter.elts
        if isinstance(node.target, ast.Name):
            columns = [(node.target, rows)]
        elif isinstance(node.target, ast.Tuple) and all(
            isinstance(row, ast.Tuple) and len(row.elts) == len(node.target.elts) for row in rows
        ):
            columns = [(name, [row.elts[i] for row in rows]) for i, name in enumerate(node.target.elts)]
        else:
            return scope
        strings = dict(scope.strings)
        for name, values in columns:
            if not isinstance(name, ast.Name):
                continue
            if any(scope.is_torch(value) for value in values):
                scope = replace(scope, torch=scope.torch | {name.id})
            if all(isinstance(value, ast.Constant) and isinstance(value.value, str) for value in values):
                strings[name.id] = frozenset(value.value for value in values)  # type: ignore[misc]
        return replace(scope, strings=strings)

    def function(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, scope: Scope, base: str | None) -> Scope:
        arguments = node.args
        params = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        params += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
        annotated = {p.arg for p in params if p.annotation is not None and scope.is_torch(p.annotation)}
        names = {p.arg for p in params}
        derived = {name: used for name, used in scope.derived.items() if name not in names}
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in getattr(node, "decorator_list", []))
        if base is not None and params and not static:
            derived[params[0].arg] = used_by_torch(base)
        return Scope((scope.torch - names) | annotated, scope.strings, derived)

    calls = "setattr" in source or "delattr" in source  # else only statements can write: expressions are skipped

    def visit(node: ast.AST, scope: Scope, base: str | None = None) -> None:
        for child in ast.iter_child_nodes(node):
            if not calls and isinstance(child, ast.expr):
                continue
            inner, child_base = scope, None
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = function(child, scope, base)
            elif isinstance(child, ast.For):
                inner = loop(child, scope)
            elif isinstance(child, ast.ClassDef):
                bases = [local.get(b.id) if isinstance(b, ast.Name) else None for b in child.bases]
                bases += [dotted(b, imported) for b in child.bases]
                child_base = local[child.name] = next(filter(None, bases), None)
            check(child, inner)
            visit(child, inner, child_base)

    local: dict[str, str | None] = {}  # this module's classes: the torch class each derives from, if any
    constants = {}  # module-level NAME = ("a", "b", ...)
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
            values = node.value.elts
            if all(isinstance(value, ast.Constant) and isinstance(value.value, str) for value in values):
                constants |= {t.id: frozenset(v.value for v in values) for t in node.targets if isinstance(t, ast.Name)}
    visit(tree, Scope(frozenset(set(imported) | made), constants, {}))
    return found


def test_no_module_writes_a_private_attribute_of_torchs():
    found = [
        write
        for module, path in sorted(modules().items())
        if module.split(".")[0] in ROOTS
        for write in private_writes(path.read_text(), module)
    ]
    assert found == []


# what ddp_core.torchrun and a test did before they used a subclass and c10d's is_host option
WRITES = """
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
import torch.distributed.optim as zero_module
import torch

def monitor(self: LocalElasticAgent, worker_group):
    self._remaining_restarts = 0

def install():
    LocalElasticAgent._monitor_workers = monitor
    SimpleElasticAgent._rendezvous += 1
    c10d_backend._matches_machine_hostname = lambda host: True
    for cls, name in ((SimpleElasticAgent, "_restart_workers"), (LocalElasticAgent, "_stop_workers")):
        setattr(cls, name, None)

def elsewhere(monkeypatch, name):
    optimizer = zero_module.ZeroRedundancyOptimizer([], torch.optim.SGD)
    optimizer._all_state_dicts = []
    del torch.distributed._x
    monkeypatch.setattr(torch.cuda, "_lazy_init", None)
    monkeypatch.setattr("torch.cuda._initialized", True)
    setattr(torch.cuda, name, None)

class Agent(LocalElasticAgent):
    def ours(self):
        self._remaining_restarts, self.count = 0, 1

class Deeper(Agent):
    def more(self):
        setattr(self, "_remaining_restarts", 1)
"""
# what stays allowed: reading torch's private state, public names, private attributes of ours
ALLOWED = """
from torch.distributed.launcher import api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
import torch

class Agent(LocalElasticAgent):
    def restarts(self) -> int:
        return self._remaining_restarts

class Stand(torch.nn.Module):  # a test's stand-in for another class's layout: a name nn.Module never uses
    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

class Ours:
    def __init__(self, torch):
        self._cache = torch._private_thing
        torch._seen = 1  # a parameter named torch is not the module

def install(monkeypatch, run):
    launcher_api.LocalElasticAgent = Agent
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run._state = torch.zeros(1)._version
    for name in ("a", "b"):
        setattr(run, "_" + name, None)
"""


def test_each_kind_of_write_is_caught_and_reads_and_our_own_attributes_are_not():
    assert [line.split(": ", 1)[1].rsplit(": ", 1)[0] for line in private_writes(WRITES, "m")] == [
        "self._remaining_restarts = 0",
        "LocalElasticAgent._monitor_workers = monitor",
        "SimpleElasticAgent._rendezvous += 1",
        "c10d_backend._matches_machine_hostname = lambda host: True",
        "setattr(cls, name, None)",
        "optimizer._all_state_dicts = []",
        "del torch.distributed._x",
        "monkeypatch.setattr(torch.cuda, '_lazy_init', None)",
        "monkeypatch.setattr('torch.cuda._initialized', True)",
        "setattr(torch.cuda, name, None)",
        "self._remaining_restarts, self.count = (0, 1)",
        "setattr(self, '_remaining_restarts', 1)",
    ]
    assert private_writes(ALLOWED, "m") == []
