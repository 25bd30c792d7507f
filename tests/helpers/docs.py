"""The fenced code blocks of docs/*.md, with their ``<!-- not-tested: reason -->`` marks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List

from tests.helpers import REPO

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
