"""Imports point one way: harness -> glue -> core, and no module of the package imports
itself back.

* The core (``megatron_muon/*.py``: the optimizer, ``checkpoint/``) never imports the
  Megatron-LM glue (``megatron_muon.megatron_lm``), the development harness
  (``megatron_muon.testing``), ``tools`` or Megatron-LM's training code (``megatron.training``).
* The glue never imports the harness.
* The harness may import both.
* No cycle among the package's modules, lazy imports (inside functions) and a package's
  lazily exported names (``_EXPORTS``) included.

Every import counts, relative or absolute, at module level or inside a function. Read from
the source with ``ast``: nothing is imported or run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, Tuple

from tests.helpers import REPO

PACKAGE = REPO / "megatron_muon"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> Iterator[Tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (a module under ``root``);
    for ``from X import a`` both ``X`` and ``X.a`` (``a`` may be a submodule)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


HARNESS = "megatron_muon.testing"
GLUE = "megatron_muon.megatron_lm"
FORBIDDEN = {
    "core": (GLUE, HARNESS, "tools", "megatron.training"),
    "glue": (HARNESS,),
}


def _part(path: Path, package: Path) -> str:
    """Which part of ``package`` holds ``path``: core, glue or harness."""
    if (package / "testing") in path.parents:
        return "harness"
    if (package / "megatron_lm") in path.parents:
        return "glue"
    return "core"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offending_imports(root: Path = PACKAGE) -> list:
    """``path:line imports module`` for every import against the direction."""
    offenders = []
    for path in sorted(root.rglob("*.py")):
        forbidden = FORBIDDEN.get(_part(path, root), ())
        offenders += [
            f"{path.relative_to(root.parent)}:{line} imports {module}"
            for line, module in imported_modules(path, root.parent)
            if any(_within(module, f) for f in forbidden)
        ]
    return offenders


def import_graph(root: Path = PACKAGE) -> dict:
    """module -> the package's modules it imports (any import; a package's ``_EXPORTS``
    count as imports of the modules they name)."""
    modules = {_module_name(p, root.parent): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, module in imported_modules(path, root.parent):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name and module != root.name:
                edges.add(module)
        if path.name == "__init__.py":
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
                    edges |= {f"{name}.{v.value}" for v in node.value.values}
        graph[name] = edges
    return graph


def import_cycles(graph: dict) -> list:
    """Every cycle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    state, path, cycles = {}, [], []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                cycles.append(" -> ".join(path[path.index(other) :] + [other]))
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_module_imports_itself_back():
    cycles = import_cycles(import_graph())
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    pkg = tmp_path / "megatron_muon"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text('_EXPORTS = {"f": "b"}\n')
    (pkg / "a.py").write_text("def f():\n    from .sub import f\n")
    (pkg / "sub" / "b.py").write_text("from ..c import g\n")
    (pkg / "c.py").write_text("import megatron_muon.a\n")
    assert import_cycles(import_graph(pkg)) == [
        "megatron_muon.a -> megatron_muon.sub -> megatron_muon.sub.b -> megatron_muon.c -> megatron_muon.a"
    ]


def test_imports_point_from_harness_to_glue_to_core():
    offenders = offending_imports()
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_relative_and_absolute_imports(tmp_path):
    pkg = tmp_path / "megatron_muon"
    (pkg / "sub").mkdir(parents=True)
    source = "from ..testing import models\nimport megatron_muon.testing.launcher\nfrom . import x\n"
    (pkg / "sub" / "mod.py").write_text(source)
    found = [m for _, m in imported_modules(pkg / "sub" / "mod.py", tmp_path) if _within(m, HARNESS)]
    assert found == ["megatron_muon.testing", "megatron_muon.testing.models", "megatron_muon.testing.launcher"]
    (pkg / "megatron_lm").mkdir()
    (pkg / "megatron_lm" / "glue.py").write_text("def f():\n    from ..testing.models import TinyModelSpec\n")
    (pkg / "core.py").write_text("from megatron.training import get_args\nfrom .megatron_lm import cpu\n")
    (pkg / "testing").mkdir()
    (pkg / "testing" / "harness.py").write_text("from ..megatron_lm import cpu\nfrom .. import core\n")
    assert sorted(offending_imports(pkg)) == [
        "megatron_muon/core.py:1 imports megatron.training",
        "megatron_muon/core.py:1 imports megatron.training.get_args",
        "megatron_muon/core.py:2 imports megatron_muon.megatron_lm",
        "megatron_muon/core.py:2 imports megatron_muon.megatron_lm.cpu",
        "megatron_muon/megatron_lm/glue.py:2 imports megatron_muon.testing.models",
        "megatron_muon/megatron_lm/glue.py:2 imports megatron_muon.testing.models.TinyModelSpec",
        "megatron_muon/sub/mod.py:1 imports megatron_muon.testing",
        "megatron_muon/sub/mod.py:1 imports megatron_muon.testing.models",
        "megatron_muon/sub/mod.py:2 imports megatron_muon.testing.launcher",
    ]


STEP = ("pipeline", "rule", "planner", "optimizer", "newton_schulz", "multirank_newton_schulz", "qk_clip", "hyperball")
"""The optimizer step's modules (``megatron_muon.<name>``): the plan, the pipeline, the maths."""
RUNS_THE_STEP = ("pipeline", "rule", "optimizer")
"""Those no checkpoint module may reach even through another (the registry of states names
the plan's types, and the plan the Newton–Schulz methods)."""


def reached_from(graph: dict, start: str) -> set:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for other in graph.get(todo.pop(), ()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def step_imports_of_checkpoints(root: Path = PACKAGE) -> list:
    """``checkpoint module -> step module`` for every step module a module of ``checkpoint/``
    imports: directly, or at any depth those that run the step (:data:`RUNS_THE_STEP`)."""
    graph = import_graph(root)
    step = {f"{root.name}.{m}" for m in STEP}
    runs = {f"{root.name}.{m}" for m in RUNS_THE_STEP}
    out = []
    for module in sorted(m for m in graph if _within(m, f"{root.name}.checkpoint")):
        direct = graph[module] & step
        deep = reached_from(graph, module) & runs
        out += [f"{module} -> {m}" for m in sorted(direct | deep)]
    return out


def test_checkpoints_import_nothing_of_the_step():
    """The checkpoint layer reaches the step's exchanges through the optimizer object it is
    handed (``MuonPipeline.owner_state_to_holders``), never by importing the step."""
    offenders = step_imports_of_checkpoints()
    assert not offenders, "\n".join(offenders)


def test_the_step_check_sees_an_import_through_another_module(tmp_path):
    pkg = tmp_path / "megatron_muon"
    (pkg / "checkpoint").mkdir(parents=True)
    for name in ("__init__.py", "checkpoint/__init__.py", "pipeline.py"):
        (pkg / name).write_text("")
    (pkg / "state.py").write_text("from .pipeline import exchange\n")
    (pkg / "checkpoint" / "a.py").write_text("def f():\n    from ..state import x\n")
    assert step_imports_of_checkpoints(pkg) == ["megatron_muon.checkpoint.a -> megatron_muon.pipeline"]


# ---------------------------------------------------------------------------------------
# The Megatron-LM glue asks a checkpoint format; it does not branch on which one runs
# ---------------------------------------------------------------------------------------

FORMAT_WORDS = re.compile(r"fsdp|ckpt_format|torch_dist")
"""What a condition that branches on the checkpoint format (or on the engine that writes it)
mentions: a name, an attribute or a string such as ``use_megatron_fsdp``, ``ckpt_format``,
``"fsdp_dtensor"``, ``"to-torch-dist"`` (text inside an f-string aside: a message)."""
CHOOSES_THE_FORMAT = "megatron_muon/megatron_lm/integration.py:_storage"
"""The one place that chooses a run's storage backend from Megatron-LM's arguments, and with
it the checkpoint format the backend holds (``StorageBackend.checkpoint_format``)."""
ENGINE_FLAGS = {
    "megatron_muon/megatron_lm/integration.py:settings_from_args": "Megatron-FSDP's own dtype flag, mapped "
    "as Megatron-LM's validation maps it",
    "megatron_muon/megatron_lm/cpu.py:validate_args": "CUDA_DEVICE_MAX_CONNECTIONS as Megatron-LM's validation "
    "wants it under either FSDP engine",
}
"""Branches on a data-parallel engine's own flags, not on a checkpoint format: each named, so
that a new one has to be argued here."""


def _mentions_a_format(test: ast.AST) -> bool:
    messages = {id(v) for n in ast.walk(test) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(test):
        word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in messages:
            word = node.value
        if word is not None and FORMAT_WORDS.search(word):
            return True
    return False


def format_branches(path: Path, root: Path = REPO) -> list:
    """``(path:function, condition)`` of every ``if``, ``while``, ternary, boolean operation
    or comprehension filter in ``path`` whose condition mentions a checkpoint format (the
    outermost such condition only: ``a and b`` is one branch, not three)."""
    found, counted = [], set()

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = [node.test]
        elif isinstance(node, ast.BoolOp):
            tests = [node]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        for test in tests:
            if id(test) not in counted and _mentions_a_format(test):
                counted.update(id(n) for n in ast.walk(test))
                found.append((f"{path.relative_to(root)}:{function}", f"{test.lineno}: {ast.unparse(test)}"))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), "<module>")
    return found


def test_the_megatron_lm_glue_asks_the_checkpoint_format():
    """Every branch on a checkpoint format in ``megatron_lm/`` is a call on the format object
    (``checkpoint.formats``), except where a run's format is chosen (:data:`CHOOSES_THE_FORMAT`)."""
    branches = [b for path in sorted((PACKAGE / "megatron_lm").glob("*.py")) for b in format_branches(path)]
    places = {place for place, _ in branches}
    assert CHOOSES_THE_FORMAT in places  # the check sees the one it allows
    others = [
        f"{place}:{line}" for place, line in branches if place != CHOOSES_THE_FORMAT and place not in ENGINE_FLAGS
    ]
    assert not others, "\n".join(others)


def test_the_format_branch_check_sees_ifs_ternaries_and_boolean_tests(tmp_path):
    source = (
        "def f(args, fsdp):\n"
        "    if args.ckpt_format == 'x':\n"
        "        pass\n"
        "    y = 'a' if fsdp else 'b'\n"
        "    z = args.save and getattr(args, 'use_megatron_fsdp', False)\n"
        "    w = [k for k in args if k == 'torch_dist']\n"
        "    raise ValueError(f'not fsdp_dtensor: {args.save}') if args.save else None\n"
    )
    (tmp_path / "glue.py").write_text(source)
    found = format_branches(tmp_path / "glue.py", tmp_path)
    assert [line.split(":")[0] for _, line in found] == ["2", "4", "5", "6"]
    assert {place for place, _ in found} == {"glue.py:f"}
