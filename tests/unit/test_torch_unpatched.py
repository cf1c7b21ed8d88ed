"""torch is used as it is: no module assigns to a name of torch's, and every private name of torch's it reads is
listed here with its reason. Read from the code's syntax.

A name of torch's replaced in place changes torch for the whole process, and breaks silently when a release
moves what it relied on; torch is extended through its public API and the hooks it leaves to subclasses. Caught:

- in ddp_core, experiments, tools and bench, writes of any attribute, public or private, of a name of torch's: a
  name imported from torch (a module, a class, a function), one assigned from such a name
  (``cls = api.LocalElasticAgent``), anything reached from one by attributes (``torch.a.b``), or a loop variable
  over a literal that holds one: ``X.name = value``, ``X.name += value``, ``del X.name``,
  ``setattr``/``delattr``/``object.__setattr__``/``monkeypatch.setattr`` on ``X``, ``monkeypatch.setattr("torch.a.b",
  ...)``; torch's documented switches aside (``SWITCHES``). bench patches nothing: it measures the code as users
  run it. tests/ may replace public names of torch's in their own processes (``monkeypatch``, or a fault injected
  into a spawned worker: ``torch.save`` that fails), never a private one;
- everywhere, writes of a private attribute (a leading underscore) of an object of torch's too: a name assigned
  from a call of one (``opt = ZeroRedundancyOptimizer(...)``), a parameter annotated with one
  (``self: LocalElasticAgent``), ``self`` in a method of a class derived from torch's (in this module, directly or
  through a class of the module) for a private name torch's code of those classes uses: there our attributes and
  torch's share one namespace (``self._remaining_restarts`` in a subclass of LocalElasticAgent is torch's count).
  Public attributes of torch's objects are their state, set as torch documents (``parameter.requires_grad``);
- ``setattr``/``delattr`` on any of these with a name it cannot read (not a constant, nor a loop variable over
  constants).

Private reads (``X._name`` with ``X`` as above, and ``from torch.a import _b``), in ddp_core, experiments and
tools, are allowed where ``PRIVATE_READS`` lists them with their reason; a listed read that is gone fails too,
so the list stays what remains.

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
READ_ROOTS = ("ddp_core", "experiments", "tools")  # the code users run; bench and tests may read more
# torch's documented switches: setting them is how torch asks to be configured
SWITCHES = {
    "torch.backends.cudnn.deterministic": "torch's reproducibility switch (docs: Reproducibility)",
    "torch.backends.cudnn.benchmark": "torch's autotuner switch (docs: Reproducibility, torch.backends)",
    "torch.backends.cuda.matmul.allow_tf32": "TF32 matmuls (docs: torch.backends, TF32 on Ampere)",
    "torch.backends.cudnn.allow_tf32": "TF32 convolutions (docs: torch.backends, TF32 on Ampere)",
}
# the private names of torch's the code still reads, each where no public API gives the same
_BATCHNORM = "the base of every BatchNorm class (and of torch's SyncBatchNorm): the one isinstance for them all"
PRIVATE_READS = {
    "ddp_core.distributed.collectives: torch._utils._flatten_dense_tensors": "many tensors in one collective, as "
    "torch's DDP does",
    "ddp_core.distributed.collectives: torch._utils._unflatten_dense_tensors": "the same tensors back out",
    "ddp_core.distributed.flight_recorder: torch._C._distributed_c10d._dump_fr_trace_json": "the flight "
    "recorder's dump on demand: torch has no public call for it",
    "ddp_core.distributed.group: dist.distributed_c10d._set_pg_timeout": "a live group's timeout on a torch "
    "without dist.set_timeout (read only where that is missing)",
    "ddp_core.distributed.group: model._orig_mod": "the module torch.compile wrapped: OptimizedModule keeps it "
    "only there",
    "ddp_core.distributed.sync_batchnorm: self._check_input_dim": "our override of the check _BatchNorm leaves "
    "to its subclasses",
    "ddp_core.distributed.sync_batchnorm: torch.distributed._functional_collectives": "an all-reduce "
    "torch.compile traces (funcol): no public module offers one",
    "ddp_core.distributed.sync_batchnorm: torch.nn.modules.batchnorm._BatchNorm": _BATCHNORM,
    "ddp_core.training.replicas: nn.modules.batchnorm._BatchNorm": _BATCHNORM,
    "ddp_core.process.agent: self._stop_workers": "the hook LocalElasticAgent leaves to subclasses, overridden "
    "and called",
    "ddp_core.process.agent: self._pcontext": "the agent's workers (their handlers' processes): a failed job's "
    "others are closed from the watch torch leaves to subclasses",
    "ddp_core.process.agent: self._remaining_restarts": "which restart this is, as torch counts it for "
    "TORCHELASTIC_RESTART_COUNT (the timeline)",
    "ddp_core.torchrun: torch_run.get_args_parser()._option_string_actions": "torchrun's own option names, to "
    "tell its flags from the program's",
    "ddp_core.training.buckets: model._has_rebuilt_buckets": "whether DDP has rebuilt its buckets in the order "
    "of the first backward: DDP says it nowhere else",
    "ddp_core.training.comm: model._get_ddp_logging_data": "DDP's bucket sizes as its logger records them: the "
    "bytes one synchronizing pass sends",
    "ddp_core.training.profiling: torch.cuda.memory._record_memory_history": "the CUDA memory snapshot, under "
    "the names torch documents it (Understanding CUDA Memory Usage)",
    "ddp_core.training.profiling: torch.cuda.memory._dump_snapshot": "the same snapshot, written",
    "ddp_core.training.step_time: Variable._execution_engine": "queue_callback: the end of a backward pass, "
    "after DDP's own callback; no public hook runs there",
}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def root(node: ast.AST) -> str | None:
    """The name an expression starts from: ``torch`` in ``torch.a.b[0].c()``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_imports(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """``{name: its path in torch}`` for the names the imports of torch bind (``dist``: ``torch.distributed``) and
    the names assigned from one of them (``cls = api.LocalElasticAgent``), and the names assigned from a call of
    one anywhere in the module (``opt = ZeroRedundancyOptimizer(...)``)."""
    names, assigns = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _torch(alias.name):
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and _torch(node.module or ""):
            names |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Assign):
            assigns.append(node)
    made = set()
    for node in assigns:
        path = dotted(node.value, names)
        for target in (t.id for t in node.targets if isinstance(t, ast.Name)):
            if path is not None:
                names[target] = path
            elif isinstance(node.value, ast.Call) and root(node.value) in names:
                made.add(target)
    return names, made


def _torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def dotted(node: ast.AST, imported: Mapping[str, str]) -> str | None:
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
    names: frozenset[str]  # names of torch's here: its modules, classes, functions
    torch: frozenset[str]  # those, and objects of torch's: made by a call of one, parameters annotated with one
    strings: Mapping[str, frozenset[str]]  # names whose string values are known: loop variables, module constants
    derived: Mapping[str, frozenset[str] | None]  # a torch subclass's method's self: torch's private names there

    def is_torch(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return False
        return root(node) in self.torch

    def named(self, node: ast.AST) -> bool:
        """``node`` is a name of torch's: ``torch.a.b``, not ``torch.f().b``."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in self.names

    def owns(self, node: ast.AST, name: str) -> bool:
        """``name`` on ``node`` is a private attribute of torch's (to write or to read)."""
        if not private(name):
            return False
        if self.is_torch(node):
            return True
        if isinstance(node, ast.Name) and node.id in self.derived:
            used = self.derived[node.id]
            return used is None or name in used
        return False


def torch_uses(source: str, where: str) -> tuple[list[str], set[str]]:
    """The writes to torch's attributes in ``source`` (``where:line: code: why``), and its private reads of
    torch's (``where: X._name``)."""
    if "torch" not in source:  # nothing of torch's to name, nor "torch.a.b" to patch
        return [], set()
    tree = ast.parse(source)
    imported, made = torch_imports(tree)
    in_tests = where.split(".")[0] == "tests"
    found: list[str] = []
    reads: set[str] = set()

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {ast.unparse(node)}: {what}")

    def writes(scope: Scope, node: ast.AST, name: str) -> bool:
        if scope.owns(node, name):
            return True
        return not in_tests and scope.named(node) and f"{dotted(node, imported)}.{name}" not in SWITCHES

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
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and scope.owns(node.value, node.attr):
            reads.add(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            name = node.args[1] if len(node.args) > 1 else None  # getattr(X, "_name", default): a read all the same
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and scope.owns(node.args[0], name.value):
                reads.add(f"{where}: {ast.unparse(node.args[0])}.{name.value}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and _torch(getattr(node, "module", None) or "torch"):
            paths = [
                alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}" for alias in node.names
            ]
            reads.update(f"{where}: {path}" for path in paths if _torch(path) and any(map(private, path.split("."))))
        for target in targets(node):
            if isinstance(target, ast.Attribute) and writes(scope, target.value, target.attr):
                report(node, "writes an attribute of torch's")
        if isinstance(node, ast.Call) and node.args:
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if called in SETTERS:
                setter(node, scope)

    def setter(node: ast.Call, scope: Scope) -> None:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):  # monkeypatch.setattr("a.b.c", v)
            if _torch(first.value) and (private(first.value.rsplit(".", 1)[-1]) or not in_tests):
                report(node, "replaces an attribute of torch's")
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
        elif names is not None and any(writes(scope, first, each) for each in names):
            report(node, "replaces an attribute of torch's")

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
            if any(scope.named(value) for value in values):
                scope = replace(scope, names=scope.names | {name.id})
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
        return Scope(scope.names - names, (scope.torch - names) | annotated, scope.strings, derived)

    def visit(node: ast.AST, scope: Scope, base: str | None = None) -> None:
        for child in ast.iter_child_nodes(node):
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
    visit(tree, Scope(frozenset(imported), frozenset(set(imported) | made), constants, {}))
    return found, {read for read in reads if not any(other.startswith(read + ".") for other in reads)}  # outermost


@cache
def the_tree() -> tuple[list[str], set[str]]:
    writes, reads = [], set()
    for module, path in sorted(modules().items()):
        if module.split(".")[0] in ROOTS:
            found, read = torch_uses(path.read_text(), module)
            writes += found
            reads |= read if module.split(".")[0] in READ_ROOTS else set()
    return writes, reads


def test_no_module_writes_an_attribute_of_torchs():
    assert the_tree()[0] == []


def test_the_private_reads_of_torch_are_the_listed_ones():
    reads = the_tree()[1]
    assert sorted(reads - set(PRIVATE_READS)) == []  # a new one: add it to PRIVATE_READS with its reason
    assert sorted(set(PRIVATE_READS) - reads) == []  # gone: remove it from the list


# what ddp_core.torchrun, the comm-bytes count, the write audit and a test did before they used torch's pieces
WRITES = """
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.launcher import api as launcher_api
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
import torch.distributed.optim as zero_module
import torch

def monitor(self: LocalElasticAgent, worker_group):
    self._remaining_restarts = 0

def install(f, proxy):
    LocalElasticAgent._monitor_workers = monitor
    SimpleElasticAgent._rendezvous += 1
    c10d_backend._matches_machine_hostname = lambda host: True
    for cls, name in ((SimpleElasticAgent, "_restart_workers"), (LocalElasticAgent, "_stop_workers")):
        setattr(cls, name, None)
    launcher_api.LocalElasticAgent = Agent
    PContext.close = f
    for module in (default_hooks, powerSGD_hook):
        module.dist = proxy
    torch.save = f
    setattr(subprocess_handler, "Popen", f)
    cls = launcher_api.LocalElasticAgent
    del cls.run

def elsewhere(monkeypatch, name):
    optimizer = zero_module.ZeroRedundancyOptimizer([], torch.optim.SGD)
    optimizer._all_state_dicts = []
    del torch.distributed._x
    monkeypatch.setattr(torch.cuda, "_lazy_init", None)
    monkeypatch.setattr("torch.cuda._initialized", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    setattr(torch.cuda, name, None)

class Agent(LocalElasticAgent):
    def ours(self):
        self._remaining_restarts, self.count = 0, 1

class Deeper(Agent):
    def more(self):
        setattr(self, "_remaining_restarts", 1)
"""
# allowed everywhere: torch's switches, public state of torch's objects, attributes of ours; reads are listed apart
ALLOWED = """
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
import torch

class Agent(LocalElasticAgent):
    def restarts(self) -> int:
        self.count = 1
        return self._remaining_restarts

class Stand(torch.nn.Module):  # a test's stand-in for another class's layout: a name nn.Module never uses
    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

class Ours:
    def __init__(self, torch):
        self._cache = torch._private_thing
        torch._seen = 1  # a parameter named torch is not the module

def install(run):
    torch.backends.cudnn.deterministic = True
    layer = torch.nn.Linear(1, 1)
    layer.weight.requires_grad = False
    run._state = torch.zeros(1)._version
    for name in ("a", "b"):
        setattr(run, "_" + name, None)
"""
# allowed in tests only: public names of torch's replaced in the test's own process
IN_TESTS = """
import torch

def test(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    torch.save = None
"""
READS = """
from torch._utils import _flatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel
import torch

def sizes(model: DistributedDataParallel):
    return model._get_ddp_logging_data(), torch._C._distributed_c10d._dump_fr_trace_json, model.module._x
"""


def test_each_kind_of_write_is_caught_and_reads_and_our_own_attributes_are_not():
    assert [line.split(": ", 1)[1].rsplit(": ", 1)[0] for line in torch_uses(WRITES, "m")[0]] == [
        "self._remaining_restarts = 0",
        "LocalElasticAgent._monitor_workers = monitor",
        "SimpleElasticAgent._rendezvous += 1",
        "c10d_backend._matches_machine_hostname = lambda host: True",
        "setattr(cls, name, None)",
        "launcher_api.LocalElasticAgent = Agent",
        "PContext.close = f",
        "module.dist = proxy",
        "torch.save = f",
        "setattr(subprocess_handler, 'Popen', f)",
        "del cls.run",
        "optimizer._all_state_dicts = []",
        "del torch.distributed._x",
        "monkeypatch.setattr(torch.cuda, '_lazy_init', None)",
        "monkeypatch.setattr('torch.cuda._initialized', True)",
        "monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)",
        "monkeypatch.setattr('torch.cuda.device_count', lambda: 0)",
        "setattr(torch.cuda, name, None)",
        "self._remaining_restarts, self.count = (0, 1)",
        "setattr(self, '_remaining_restarts', 1)",
    ]
    assert torch_uses(ALLOWED, "bench.m")[0] == []
    assert torch_uses(IN_TESTS, "tests.m")[0] == [] and len(torch_uses(IN_TESTS, "bench.m")[0]) == 3
    assert len(torch_uses(WRITES, "tests.m")[0]) == 20 - 8  # the public names


def test_private_reads_of_torch_are_found_outermost_and_imports_with_them():
    assert sorted(torch_uses(READS, "m")[1]) == [
        "m: model._get_ddp_logging_data",
        "m: model.module._x",
        "m: torch._C._distributed_c10d._dump_fr_trace_json",
        "m: torch._utils._flatten_dense_tensors",
    ]
