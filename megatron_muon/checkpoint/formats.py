"""Every checkpoint format megatron_muon writes, by name, and which one a directory holds
(what a format is: :mod:`.format`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .format import CheckpointFormat
from .fsdp_dtensor import FSDP_DTENSOR
from .integrity import record
from .torch_dist import TORCH_DIST

FORMATS: Dict[str, CheckpointFormat] = {f.name: f for f in (TORCH_DIST, FSDP_DTENSOR)}
"""Every format by name, in the order :func:`detect` asks them (a torch_dist directory holds
DCP files too)."""


def named(name: Any) -> Optional[CheckpointFormat]:
    """The format called ``name`` (Megatron-LM's ``--ckpt-format``), None for another."""
    return FORMATS.get(name) if isinstance(name, str) else None


def default() -> CheckpointFormat:
    """Megatron-core's default format (torch_dist), what a directory of no known format is
    taken for where one must be assumed."""
    return TORCH_DIST


def detect(path: str) -> Optional[CheckpointFormat]:
    """The format of the checkpoint directory ``path``: what our record says, else what its
    files are (each format asked in turn); None when neither."""
    recorded = named(record(path).get("format"))
    if recorded is not None:
        return recorded
    return next((f for f in FORMATS.values() if f.detect(path)), None)
