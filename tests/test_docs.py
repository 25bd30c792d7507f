"""The documentation is executable: every fenced shell block in docs/*.md runs (from the
repository root, with this interpreter's environment first on PATH) and must succeed,
unless the line right before it is ``<!-- not-tested: reason -->`` (installs, GPU
clusters, long runs). Python blocks must at least compile. Relative links must point at
files that exist, and the MuonConfig table of docs/usage.md must be current.

Benchmark scripts in the docs write to a temporary directory ($MEGATRON_MUON_BENCH_OUT),
never over the committed results in docs/bench.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SHELLS = ("bash", "sh", "shell")
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_TESTED = re.compile(r"^<!--\s*not-tested:\s*(.+?)\s*-->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str
    skip: str  # the not-tested reason, or ""

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: Path) -> List[Block]:
    """Fenced code blocks of a markdown file, with their not-tested marks."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        mark = NOT_TESTED.match(lines[start - 1].strip()) if start else None
        out.append(Block(path, start + 1, lang, "\n".join(body), mark.group(1) if mark else ""))
        i += 1
    return out


ALL = [b for p in sorted(DOCS.glob("*.md")) for b in blocks(p)]
# Each distinct command runs once (index.md and usage.md share the first-run command).
SHELL = list({b.text: b for b in reversed(ALL) if b.lang in SHELLS and not b.skip}.values())[::-1]


def test_the_docs_exist():
    for name in ("index", "usage", "design", "recipes", "checkpoints", "benchmarks", "api"):
        assert (DOCS / f"{name}.md").is_file(), name
    assert SHELL, "no runnable shell blocks found"


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: b.id)
def test_untested_blocks_say_why(block):
    assert len(block.skip) > 3 and block.lang in SHELLS, f"{block.id}: not-tested needs a reason, on a shell block"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.id)
def test_shell_block_runs(block, tmp_path):
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MEGATRON_MUON_BENCH_OUT"] = str(tmp_path / "bench")
    env.setdefault("PYTHONWARNINGS", "ignore")
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=230,
    )
    assert result.returncode == 0, (
        f"{block.id} failed ({result.returncode}):\n{block.text}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_compiles(block):
    compile(block.text, block.id, "exec")


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target, _ in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_config_table_is_current():
    """Every MuonConfig field is in docs/usage.md, with its current default and docstring."""
    from tools.bench import config_reference

    text = config_reference.USAGE.read_text()
    assert config_reference.render(text) == text, "run: python tools/bench/config_reference.py"
