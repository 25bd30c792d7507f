"""The documentation, read without running it: every page exists, every not-tested shell
block says why, python blocks compile, relative links point at files that exist, and the
MuonConfig table of docs/usage.md is current. (The shell blocks run in
``tests/e2e/test_docs.py``.)
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.docs import ALL, DOCS, SHELL, SHELLS


def test_the_docs_exist():
    for name in ("index", "usage", "design", "recipes", "checkpoints", "benchmarks", "api"):
        assert (DOCS / f"{name}.md").is_file(), name
    assert SHELL, "no runnable shell blocks found"


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: b.id)
def test_untested_blocks_say_why(block):
    assert len(block.skip) > 3 and block.lang in SHELLS, f"{block.id}: not-tested needs a reason, on a shell block"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_compiles(block):
    compile(block.text, block.id, "exec")


@pytest.mark.parametrize("block", [b for b in SHELL if "torchrun" in b.text], ids=lambda b: b.id)
def test_runnable_torchrun_lines_pick_a_free_port(block):
    """A block the suite runs must not take torchrun's default port 29500: two such blocks on
    the two pytest workers at once failed with EADDRINUSE (a fresh-clone CI run)."""
    for line in block.text.splitlines():
        if line.lstrip().startswith("torchrun"):
            assert any(f in line for f in ("--standalone", "--rdzv-endpoint", "--master-port")), f"{block.id}: {line}"


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target, _ in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_config_table_is_current():
    """Every MuonConfig field is in docs/usage.md, with its current default and docstring."""
    from tools import config_reference

    text = config_reference.USAGE.read_text()
    assert config_reference.render(text) == text, "run: python tools/config_reference.py"


def test_config_table_lists_every_field():
    from megatron_muon.config import MuonConfig
    from tools import config_reference

    table = config_reference.table()
    for name in MuonConfig.__dict__["__annotations__"]:
        assert f"`{name}`" in table, name
