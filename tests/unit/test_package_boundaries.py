"""The library never reaches into its test harness.

``megatron_muon.testing`` (tiny models, the gloo launcher) may import the library; nothing
else under ``megatron_muon/`` may import ``megatron_muon.testing``, directly or relatively,
at module level or inside a function. Read from the source with ``ast``: nothing is
imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

from tests.helpers import REPO

PACKAGE = REPO / "megatron_muon"
HARNESS = "megatron_muon.testing"


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


def _is_harness(module: str) -> bool:
    return module == HARNESS or module.startswith(HARNESS + ".")


def test_library_does_not_import_the_test_harness():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "testing") in path.parents:
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
                      for line, module in imported_modules(path) if _is_harness(module)]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_relative_and_absolute_imports(tmp_path):
    pkg = tmp_path / "megatron_muon"
    (pkg / "sub").mkdir(parents=True)
    source = "from ..testing import models\nimport megatron_muon.testing.launcher\nfrom . import x\n"
    (pkg / "sub" / "mod.py").write_text(source)
    found = [m for _, m in imported_modules(pkg / "sub" / "mod.py", tmp_path) if _is_harness(m)]
    assert found == ["megatron_muon.testing", "megatron_muon.testing.models", "megatron_muon.testing.launcher"]


def test_megatron_lm_glue_stays_thin():
    # Issue 18: Megatron-LM's training, arguments and checkpointing run as its own code;
    # megatron_muon/megatron_lm/ holds only what Megatron-LM lacks, under 1,200 lines.
    lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / "megatron_lm").glob("*.py"))
    assert lines < 1200, f"megatron_muon/megatron_lm/ has {lines} lines; the target is under 1,200"
