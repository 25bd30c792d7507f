"""Checkpoints: what megatron_muon writes and how it reads them, in one layer.

* :mod:`.format`, :mod:`.formats`: what a checkpoint format is, one object per format
  (:mod:`.torch_dist`, :mod:`.fsdp_dtensor`: the optimizer's save and load, detecting a
  directory, its common state, the converter's read and write), and which one a directory holds;
* :mod:`.optimizer_state`: the optimizer's state in model coordinates (torch_dist's), and the
  one check of whether optimizer state is ours and holds what a run loads;
* :mod:`.training_state`: :func:`save_checkpoint` / :func:`load_checkpoint` of a whole
  training state, for a loop of your own;
* :mod:`.publish`: the one routine every writer goes through (staged, manifest, verified,
  swapped into place, tracker);
* :mod:`.integrity`: the manifest, written last and verified first;
* :mod:`.unpickling`: reading never runs code stored in a checkpoint;
* :mod:`.save_lock`: one job per save directory;
* :mod:`.errors`: what a checkpoint that cannot be used raises.

Megatron-LM's directory layout (iterations, tracker), its save and load hooks and what the
converter needs of it live in ``megatron_muon.megatron_lm`` (``checkpoint_dirs``,
``checkpoint_guards``, ``converter_support``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CheckpointError": "errors",
    "CheckpointIntegrityError": "errors",
    "UnsafeCheckpointError": "errors",
    "SaveDirectoryLockedError": "errors",
    "save_checkpoint": "training_state",
    "load_checkpoint": "training_state",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .errors import (  # noqa: F401
        CheckpointError,
        CheckpointIntegrityError,
        SaveDirectoryLockedError,
        UnsafeCheckpointError,
    )
    from .training_state import load_checkpoint, save_checkpoint  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_muon.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
