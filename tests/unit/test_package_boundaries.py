"""Imports point one way: harness -> glue -> core.

* The core (``megatron_muon/*.py``: the optimizer) never imports the Megatron-LM glue
  (``megatron_muon.megatron_lm``), the development harness (``megatron_muon.testing``),
  ``tools`` or Megatron-LM's training code (``megatron.training``).
* The glue never imports the harness.
* The harness may import both.

Every import counts, relative or absolute, at module level or inside a function. Read from
the source with ``ast``: nothing is imported or run.
"""

from __future__ import annotations

import ast
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
