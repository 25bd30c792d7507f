"""``--muon-*`` command-line flags generated from :class:`megatron_muon.MuonConfig`.

Every dataclass field whose name starts with ``muon_`` becomes a flag (``muon_tp_mode`` ->
``--muon-tp-mode``), typed from the field's annotation, defaulting to the field's default
and documented by the field's docstring. New fields therefore appear on the command line
without touching this module. Types:

* ``bool``: ``--muon-x`` / ``--no-muon-x``, plus Megatron-LM's spelling ``--muon-no-x``
  (e.g. ``--muon-no-split-qkv``) and the aliases in :data:`MEGATRON_ALIASES`;
* ``torch.dtype``: a name, ``bf16`` / ``fp32`` / ``fp16`` (or ``bfloat16`` ...);
* ``Tuple[str, ...]``: zero or more strings (``--muon-exclude-patterns '*.linear_proj.weight'``);
* ``int`` / ``float`` / ``str`` (and ``Optional`` of these): as is.

Fields of other types (callables such as ``muon_param_filter``) cannot be given on a
command line; they are listed by :func:`non_cli_fields`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_muon.config import MuonConfig, field_docstrings

DTYPES: Dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
HINTS: Dict[str, Any] = typing.get_type_hints(MuonConfig)
"""MuonConfig's field annotations, resolved (the kind of flag each field gets)."""
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}

# Megatron-LM's own spellings of the same settings (its arguments.py).
MEGATRON_ALIASES: Dict[str, List[str]] = {"muon_nesterov": ["--muon-use-nesterov"]}

# Megatron-LM values that mean one of ours. Megatron's 'distributed' TP mode gathers the
# tensor-parallel shards and orthogonalizes the whole matrix: exact, as our 'exact'.
VALUE_TRANSLATIONS: Dict[str, Dict[str, str]] = {"muon_tp_mode": {"distributed": "exact"}}


def parse_dtype(value: str) -> torch.dtype:
    """``'bf16'`` -> ``torch.bfloat16`` (argparse ``type=``)."""
    key = str(value).lower().replace("torch.", "")
    if key not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; use one of {sorted(set(DTYPES))}")
    return DTYPES[key]


VALUE_KINDS: Dict[str, Dict[str, Any]] = {
    "int": dict(type=int),
    "float": dict(type=float),
    "str": dict(type=str),
    "dtype": dict(type=parse_dtype, metavar="{bf16,fp32,fp16}"),
    "str_tuple": dict(nargs="*", type=str),
}
"""argparse keywords of each kind of field other than bool."""


class BoolFlag(argparse.Action):
    """A boolean with positive and negative spellings (``--muon-x``, ``--no-muon-x``...)."""

    def __init__(self, option_strings, dest, negatives: Sequence[str] = (), **kwargs) -> None:
        self.negatives = tuple(negatives)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _kind(tp: Any) -> Optional[str]:
    """'bool' | 'int' | 'float' | 'str' | 'dtype' | 'str_tuple' | None (not expressible)."""
    tp = _unwrap_optional(tp)
    if tp in (bool, int, float, str):
        return tp.__name__
    if tp is torch.dtype:
        return "dtype"
    if typing.get_origin(tp) in (tuple, list):
        args = typing.get_args(tp)
        if args and args[0] is str:
            return "str_tuple"
    return None


def muon_fields() -> List[dataclasses.Field]:
    """The ``muon_*`` fields of ``MuonConfig`` (own and inherited from ``OptimizerConfig``)."""
    return [f for f in dataclasses.fields(MuonConfig) if f.name.startswith("muon_")]


def non_cli_fields() -> List[str]:
    """``muon_*`` fields whose type has no command-line form (set them from Python)."""
    return [f.name for f in muon_fields() if _kind(HINTS[f.name]) is None]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_muon_arguments(parser: argparse.ArgumentParser, reuse_existing: bool = False) -> None:
    """Add one flag per ``muon_*`` field of ``MuonConfig`` (used with ``--optimizer muon``).

    With ``reuse_existing`` (a parser that already defines some ``--muon-*`` flags, such as
    Megatron-LM's), option strings the parser already has are left to it and only the
    missing spellings are added (a boolean's ``--no-muon-x`` next to Megatron's
    ``--muon-x``, for instance); without it, a clash is argparse's error.
    """
    group = parser.add_argument_group("Muon (generated from megatron_muon.MuonConfig; used with --optimizer muon)")
    taken = set(parser._option_string_actions) if reuse_existing else set()
    docs = field_docstrings(MuonConfig)
    for f in muon_fields():
        kind = _kind(HINTS[f.name])
        if kind is None:
            continue
        default = _default(f)
        flag = flag_name(f.name)
        # argparse %-formats help strings; a docstring's "80 %" must reach it as "80 %%".
        help_text = docs.get(f.name, "").replace("%", "%%")
        if kind == "bool":
            short = f.name[len("muon_") :].replace("_", "-")
            negatives = [f"--no-{flag[2:]}", f"--muon-no-{short}"]
            options = [o for o in (flag, *negatives, *MEGATRON_ALIASES.get(f.name, [])) if o not in taken]
            if options:
                group.add_argument(
                    *options,
                    dest=f.name,
                    action=BoolFlag,
                    negatives=negatives,
                    default=default,
                    help=f"{help_text} (default: {default}; disable with {negatives[0]})",
                )
        elif flag not in taken:
            shown = DTYPE_NAMES.get(default) if kind == "dtype" else default
            if kind == "str_tuple":
                shown, default = " ".join(default or ()) or "none", list(default or ())
            group.add_argument(
                flag, dest=f.name, default=default, help=f"{help_text} (default: {shown})", **VALUE_KINDS[kind]
            )


def muon_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``muon_*`` keyword arguments of ``MuonConfig`` from parsed arguments."""
    out: Dict[str, Any] = {}
    for f in muon_fields():
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(value, str):
            value = VALUE_TRANSLATIONS.get(f.name, {}).get(value, value)
        if _kind(HINTS[f.name]) == "str_tuple" and value is not None:
            value = tuple(value)
        out[f.name] = value
    return out
