#!/usr/bin/env python
"""The ``MuonConfig`` reference table of ``docs/usage.md``, generated from the dataclass.

Every field ``MuonConfig`` declares is listed with its type, default, command-line flag
(the training driver generates its ``--muon-*`` flags from the same fields) and the
docstring under the field. The table lives between two marker comments in
``docs/usage.md``; ``--check`` exits non-zero when it is stale, and a field without a
docstring is an error, so every field stays documented.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import List

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
BEGIN = "<!-- BEGIN generated: MuonConfig fields (python tools/config_reference.py) -->"
END = "<!-- END generated: MuonConfig fields -->"


def _type_name(tp) -> str:
    text = str(tp).replace("typing.", "")
    return getattr(tp, "__name__", text) if not text.startswith(("Optional", "Tuple", "Callable")) else text


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 20} Mi)"
    return f"`{value!r}`" if not str(value).startswith("torch.") else f"`{value}`"


def own_fields() -> List[dataclasses.Field]:
    """The fields ``MuonConfig`` declares itself, in declaration order."""
    from megatron_muon.config import MuonConfig

    declared = list(MuonConfig.__dict__.get("__annotations__", {}))
    by_name = {f.name: f for f in dataclasses.fields(MuonConfig)}
    return [by_name[name] for name in declared]


def table() -> str:
    """The markdown table (raises when a field has no docstring)."""
    from megatron_muon.config import MuonConfig, field_docstrings
    from megatron_muon.megatron_lm import muon_args

    docs = field_docstrings(MuonConfig)
    hints = typing.get_type_hints(MuonConfig)
    no_flag = set(muon_args.non_cli_fields())
    rows = []
    for f in own_fields():
        if f.name == "optimizer":
            # Inherited field; its docstring is Megatron's generic one.
            doc = "Selects megatron_muon's Muon (Megatron-LM: `--optimizer muon`); leave it as is."
            rows.append([f"`{f.name}`", "str", _default(f), "`--optimizer muon`", doc])
            continue
        if f.name not in docs:
            raise ValueError(
                f"MuonConfig.{f.name} has no docstring: add one under the field in megatron_muon/config.py"
            )
        flag = "(Python only)" if f.name in no_flag else f"`{muon_args.flag_name(f.name)}`"
        rows.append([f"`{f.name}`", _type_name(hints[f.name]), _default(f), flag, docs[f.name].replace("|", "\\|")])
    lines = ["| field | type | default | flag | meaning |", "|---|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def render(text: str) -> str:
    """``text`` with the block between the markers replaced by the current table."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{USAGE} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/usage.md's table is stale")
    p.add_argument("--file", type=Path, default=USAGE)
    args = p.parse_args(argv)
    text = args.file.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.file}: the MuonConfig table is stale; run python tools/config_reference.py")
            return 1
        print(f"{args.file}: the MuonConfig table is current ({len(own_fields())} fields)")
        return 0
    if new != text:
        args.file.write_text(new)
        print(f"updated {args.file}")
    else:
        print(f"{args.file} already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
