"""The table of what megatron_muon changes in Megatron (``megatron_lm/patches.py``) and its one
installer (``megatron_muon/patching.py``).

* Every row's target exists in the installed Megatron / torch with the signature (and, where
  the replacement restates part of it, the source) it was written against; a mismatch fails
  naming the row and why it exists.
* Installing, undoing and reinstalling the groups in every order leaves each attribute as
  Megatron's own object (identity), and stacks the rows on one attribute in the table's order.
* The CPU rows are installed on the CPU path only.
* Read with ``ast``: no module of the package assigns an attribute of Megatron's or torch's
  outside the installer, but for :data:`NOT_IN_THE_TABLE` (each with its reason).
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import itertools
import sys
import types

import pytest

from megatron_muon import patching
from megatron_muon.megatron_fsdp_fix import SINGLE_RANK_GROUPS
from megatron_muon.megatron_lm import patches
from megatron_muon.patching import Patch
from tests.helpers import REPO
from tests.helpers.megatron_lm import megatron_functions_of_its_own

PACKAGE = REPO / "megatron_muon"


@pytest.fixture(autouse=True)
def nothing_in_force():
    """Each test starts with Megatron's own functions."""
    with megatron_functions_of_its_own():
        yield


# ---------------------------------------------------------------------------------------
# The table against the installed Megatron
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: f"{p.target}.{p.attribute}@{p.stack}")
def test_every_target_is_what_its_patch_was_written_against(patch):
    package, _, version = patch.checked.partition(" ")
    installed = importlib.metadata.version(package).split("+")[0]
    assert installed == version, f"patch {patch.name} was checked against {patch.checked}, {installed} is installed"
    problem = patching.mismatch(patch, *_written_against(patch))
    assert problem is None, problem
    value = patching.original(patch)
    if callable(value) and not isinstance(value, types.ModuleType) and not patch.adds:
        assert (patch.target, patch.attribute) in patches.WRITTEN_AGAINST, (
            f"patch {patch.name}: declare the signature it was written against in patches.WRITTEN_AGAINST"
        )


def _written_against(patch):
    return patches.WRITTEN_AGAINST.get((patch.target, patch.attribute), (None, None))


def test_the_table_is_consistent():
    rows = patches.PATCHES
    assert len(set(rows)) == len(rows), "a row appears twice"
    by_slot = {}
    for p in rows:
        by_slot.setdefault((p.target, p.attribute), []).append(p)
    for slot, ps in by_slot.items():
        assert len({p.stack for p in ps}) == len(ps), f"{slot}: two rows share a stack position"
    for p in rows:
        assert p.why and p.checked.split(" ")[0] in ("megatron-core", "torch"), p.name


def test_a_doctored_target_fails_naming_the_patch(monkeypatch):
    """A Megatron upgrade that changes a target: the row's check names it and its reason."""
    import megatron.training.arguments as arguments

    row = next(p for p in patches.PARSE_SCOPE)
    assert patching.mismatch(row, *_written_against(row)) is None
    monkeypatch.setattr(arguments, "parse_args", lambda extra_args_provider=None: None)
    problem = patching.mismatch(row, *_written_against(row))
    assert problem is not None and row.name in problem and row.why in problem and "signature" in problem
    monkeypatch.delattr(arguments, "parse_args")
    assert "has no attribute 'parse_args'" in patching.mismatch(row, *_written_against(row))
    restated = patches.WRITER_QUEUE[0]
    assert patching.mismatch(restated, *_written_against(restated)) is None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def get_write_results_queue(mp_mode="spawn"):
        return None  # other code behind the same signature

    get_write_results_queue.__signature__ = inspect.signature(filesystem_async.get_write_results_queue)
    monkeypatch.setattr(filesystem_async, "get_write_results_queue", get_write_results_queue)
    problem = patching.mismatch(restated, *_written_against(restated))
    assert problem is not None and "source it restates changed" in problem and restated.why in problem


# ---------------------------------------------------------------------------------------
# The installer
# ---------------------------------------------------------------------------------------


def _target_module():
    module = types.ModuleType("megatron_muon_patching_target")

    def f(x):
        return [x]

    class C:
        def m(self):
            return ["m"]

        @staticmethod
        def s(x):
            return [x]

    module.f, module.C = f, C
    return module


def wrap_f(original, tag):
    return lambda x: original(x) + [tag]


def wrap_m(original, tag):
    return lambda self: original(self) + [tag]


def added(original, tag):
    return patching.KEEP if original is not patching.MISSING else tag


@pytest.fixture
def target(monkeypatch):
    module = _target_module()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, "megatron_muon_patching_builders", sys.modules[__name__])
    return module


def _rows(stack: int):
    name, builders = "megatron_muon_patching_target", "megatron_muon_patching_builders"
    return (
        Patch(name, "f", f"{builders}:wrap_f", "test", "torch 0", stack=stack),
        Patch(f"{name}:C", "m", f"{builders}:wrap_m", "test", "torch 0", stack=stack),
        Patch(f"{name}:C", "s", f"{builders}:wrap_f", "test", "torch 0", stack=stack),
        Patch(name, "missing", f"{builders}:added", "test", "torch 0", stack=stack, adds=True),
        Patch(name, "absent", f"{builders}:wrap_f", "test", "torch 0", stack=stack),  # not there: left alone
    )


def test_install_undo_reinstall_in_every_order_restore_by_identity(target):
    f, m, s = target.f, target.C.__dict__["m"], target.C.__dict__["s"]
    layers = {tag: _rows(stack) for stack, tag in enumerate("abc")}
    for order in itertools.permutations("abc"):
        for undo_order in itertools.permutations("abc"):
            installed = {tag: patching.install(layers[tag], tag) for tag in order}
            assert patching.install(layers["a"], "other context") is installed["a"]  # idempotent
            assert target.f(0) == [0, "a", "b", "c"]  # the table's order, whatever the install order
            assert target.C().m() == ["m", "a", "b", "c"] and target.C.s(0) == [0, "a", "b", "c"]
            assert target.missing == "a" and not hasattr(target, "absent")
            assert target.f.__megatron_muon_undo__ is installed["c"].undo
            for gone, tag in enumerate(undo_order, 1):
                installed[tag].undo()
                installed[tag].undo()  # a second undo changes nothing
                left = [t for t in "abc" if t not in undo_order[:gone]]
                if left:
                    assert target.f(0) == [0, *left] and target.missing == left[0]
            assert target.f is f and target.C.__dict__["m"] is m and target.C.__dict__["s"] is s
            assert not hasattr(target, "missing") and not patching._slots
    again = patching.install(layers["b"])
    again.undo()
    assert target.f is f


def test_scopes_nest_and_leave_an_install_in_force(target):
    f = target.f
    rows = _rows(0)
    with patching.scoped(rows, "x"):
        with patching.scoped(rows, "y") as inner:  # reentrant: the layer in force
            assert target.f(0) == [0, "x"]
        assert target.f(0) == [0, "x"]
        layer = patching.install(rows, "z")
        assert layer is inner
    assert target.f(0) == [0, "x"]  # held by the install
    layer.undo()
    assert target.f is f
    other = _rows(1)[:1]
    outer = patching.install(rows, "a")
    with patching.scoped(other, "b"):
        assert target.f(0) == [0, "a", "b"]
        stale = outer.undo
        stale()
        assert target.f(0) == [0, "b"]
        patching.install(rows, "c")  # a new layer under the same key: the stale undo leaves it
        stale()
        assert target.f(0) == [0, "c", "b"]
    patching.install(rows).undo()
    assert target.f is f and not patching._slots


def _all_rows_values(leaving=()):
    return {(p.target, p.attribute): patching._raw(p.owner(), p.attribute) for p in patches.PATCHES if p not in leaving}


def test_megatron_groups_in_every_order_restore_megatron_by_identity():
    """``use_megatron_muon``, the launch validation and the CPU argument rows on Megatron-LM's
    real modules, installed and undone in every order: Megatron's own objects again (but for
    the Megatron-FSDP fix ``use_megatron_muon`` leaves in force for the process, undone last)."""
    import megatron.training.arguments as arguments

    from megatron_muon.megatron_lm import integration

    if patching._slots:
        pytest.skip("patches of another test are in force in this process")
    before = _all_rows_values()
    groups = {
        "integration": lambda: integration.use_megatron_muon(),
        "launch": lambda: patching.install(patches.LAUNCH).undo,
        "arch": lambda: patching.install(patches.CPU_DEVICE_ARCHITECTURE).undo,
        "premul": lambda: patching.install(patches.CPU_NO_PREMUL_SUM).undo,
    }
    stacked = {"launch": 4, "integration": 3, "premul": 2, "arch": 1}
    kept = SINGLE_RANK_GROUPS
    kept_slots = {(p.target, p.attribute) for p in kept}
    for order in itertools.permutations(groups):
        undos = {name: groups[name]() for name in order}
        chain, function = [], arguments.validate_args
        while function is not before[(patches.ARGUMENTS, "validate_args")]:
            chain.append(function.__megatron_muon_undo__)
            function = function.__wrapped__
        assert chain == [undos[n] for n in sorted(stacked, key=stacked.get, reverse=True)], order
        for undo_order in (order, tuple(reversed(order))):
            for name in undo_order:
                undos[name]()
            assert _all_rows_values(kept) == {k: v for k, v in before.items() if k not in kept_slots}
            assert all(patching.installed(p) for p in kept)
            undos = {name: groups[name]() for name in order}
        for undo in undos.values():
            undo()
    patching.install(kept).undo()
    assert _all_rows_values() == before and not patching._slots


# ---------------------------------------------------------------------------------------
# The CPU rows
# ---------------------------------------------------------------------------------------

CPU_GROUPS = (
    patches.CPU_CORE
    + patches.DEVICE_INDEX_SCOPE
    + patches.PLAIN_COMPILE_SCOPE
    + patches.CPU_INITIALIZATION
    + patches.CPU_DEVICE_ARCHITECTURE
    + patches.CPU_NO_PREMUL_SUM
    + patches.CPU_JIT_WARMUP
)


def test_cpu_rows_are_marked_and_a_gpu_run_installs_none(monkeypatch):
    assert {p for p in patches.PATCHES if p.cpu_only} == set(CPU_GROUPS)
    from megatron_muon.megatron_lm import cpu

    before = {p for p in patches.PATCHES if patching.installed(p)}
    monkeypatch.setattr(cpu, "use_cuda", lambda: True)
    assert cpu.install() is False
    new = {p for p in patches.PATCHES if patching.installed(p)} - before
    assert not any(p.cpu_only for p in new), new
    if new:
        patching.install(patches.WHEEL).undo()


# ---------------------------------------------------------------------------------------
# No assignment to Megatron outside the installer
# ---------------------------------------------------------------------------------------

NOT_IN_THE_TABLE = {
    ("megatron_lm/process_lifetime.py", "filesystem_async._results_queue"): "the module-level cache of the "
    "function the WRITER_QUEUE row restates (Megatron-core's own function assigns it the same way)",
    ("megatron_lm/cpu.py", "torch._dynamo.config.disable"): "a torch setting (dynamo off on the CPU path), "
    "not a replaced function",
    ("testing/traffic.py", "dist"): "the harness counting collective bytes inside one test's block, never in a run",
    ("testing/traffic.py", "pgb"): "the harness counting collective bytes inside one test's block, never in a run",
}
"""(file under megatron_muon/, assigned attribute): why it is not a row of the table."""


def _import_bound(tree: ast.AST) -> set:
    """Names a module binds to Megatron's or torch's modules and objects by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("megatron", "torch"):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("megatron", "torch"):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def assignments_to_megatron(path) -> list:
    tree = ast.parse(path.read_text(), str(path))
    bound = _import_bound(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id in ("setattr", "delattr"):
                targets = [node.args[0]]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                is_attribute = isinstance(t, ast.Attribute) or isinstance(node, ast.Call)
                if is_attribute and _root(t) in bound:
                    found.append((node.lineno, ast.unparse(t)))
    return found


def test_no_assignment_to_megatron_outside_the_installer():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "patching.py":
            continue
        for line, target in assignments_to_megatron(path):
            found.setdefault((relative, target), []).append(line)
    unexplained = {key: lines for key, lines in found.items() if key not in NOT_IN_THE_TABLE}
    assert not unexplained, f"assignments to Megatron's / torch's attributes outside patching.py: {unexplained}"
    assert not set(NOT_IN_THE_TABLE) - set(found), "NOT_IN_THE_TABLE lists what is gone: remove it"


# Megatron's objects (not its code) that the package gives a method of its own: each a hook on
# one instance, living and dying with it, so not a row of the table (whose slots are the
# attributes of modules and classes, restored by identity for the whole process).
ON_OBJECTS = {
    ("storage/distributed_optimizer.py", "unit.start_param_sync"): "the step overlap's hook on each DDP bucket "
    "group of one optimizer's buffers (pipeline.PendingStep, storage hook_param_sync): the group's all-gather "
    "runs the pending step's work on its parameters first; a later optimizer's hook replaces an earlier one's, "
    "and the hook goes with the model",
}
"""(file under megatron_muon/, assigned attribute): why a Megatron object's method is replaced there."""

OBJECT_CLASSES = (
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
    "megatron.core.optimizer.optimizer:ChainedOptimizer",
)
"""The Megatron classes whose instances the package holds (model chunks, bucket groups,
buffers, optimizers): an assignment to one of their methods' names is a hook on an object."""


def _method_names() -> set:
    import importlib

    names = set()
    for spec in OBJECT_CLASSES:
        module, _, name = spec.partition(":")
        for cls in getattr(importlib.import_module(module), name).__mro__:
            if cls is not object:
                names.update(
                    n for n, v in vars(cls).items() if callable(v) or isinstance(v, (staticmethod, classmethod))
                )
    return names


def assignments_to_methods(path, names) -> list:
    """``obj.method = ...`` / ``setattr(obj, "method", ...)`` for a method name of
    :data:`OBJECT_CLASSES`, outside the object's own class (``self``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for t in targets if isinstance(t, ast.Attribute) and t.attr in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
                targets = [ast.Attribute(node.args[0], node.args[1].value)]
        for t in targets:
            if _root(t) not in ("self", "cls"):
                found.append((node.lineno, ast.unparse(t)))
    return found


def test_methods_of_megatron_objects_are_replaced_only_where_listed():
    names = _method_names()
    assert "start_param_sync" in names and "step" in names
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "patching.py":
            continue
        for line, target in assignments_to_methods(path, names):
            found.setdefault((relative, target), []).append(line)
    unexplained = {key: lines for key, lines in found.items() if key not in ON_OBJECTS}
    assert not unexplained, f"methods of Megatron's objects replaced outside the table: {unexplained}"
    assert not set(ON_OBJECTS) - set(found), "ON_OBJECTS lists what is gone: remove it"


def test_the_ast_check_sees_an_assignment(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import megatron.training.arguments as arguments\nfrom torch import cuda\n"
        "def f(args):\n    arguments.validate_args = f\n    setattr(cuda, 'x', 1)\n    args.x = 1\n"
    )
    assert assignments_to_megatron(path) == [(4, "arguments.validate_args"), (5, "cuda")]
    path.write_text(
        "def f(group, self):\n    group.start_param_sync = f\n    self.start_param_sync = f\n"
        "    setattr(group, 'step', f)\n    group.other = f\n"
    )
    assert assignments_to_methods(path, {"start_param_sync", "step"}) == [
        (2, "group.start_param_sync"),
        (4, "group.step"),
    ]
