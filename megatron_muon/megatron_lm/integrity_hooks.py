"""Checksummed checkpoints inside Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint``.

``use_megatron_muon()`` installs two wrappers on ``megatron.training.checkpointing`` (see
``megatron_muon.integrity`` for the manifest itself):

* **save**: the module's ``dist_checkpointing`` becomes a view of Megatron-core's package
  whose ``save`` also writes the manifest, once every rank finished writing: right after a
  synchronous save, or as a finalize step of an asynchronous one (finalize steps run on
  every rank, in order, before Megatron-LM's own step that updates
  ``latest_checkpointed_iteration.txt``). So the tracker file only ever points at a
  checkpoint whose manifest is complete. Megatron's own rank-0 manifest
  (``--verify-integrity``) is replaced by ours (same file, same format, work split over
  ranks), not written twice.
* **load**: ``_load_global_dist_base_checkpoint`` (Megatron-LM's torch_dist load, called
  first for the common state and then for the tensors) verifies the manifest on every rank
  before its first read of a directory; a corrupt checkpoint fails on every rank, naming
  the file and tensor. A checkpoint without a manifest (saved by Megatron-LM without these
  hooks) loads as before, with a warning.

:func:`integrity_patches` returns the patches as ``(module, name, original, wrapper)``
tuples, the form ``use_megatron_muon`` installs and undoes.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_muon.integrity import MANIFEST, has_manifest, verify_manifest, write_manifest

logger = logging.getLogger(__name__)

_VERIFIED: Dict[str, Tuple[int, int]] = {}
"""Checkpoint directory -> (mtime_ns, size) of the manifest it was verified against."""


class DistCheckpointingWithManifest:
    """``megatron.core.dist_checkpointing`` as Megatron-LM's checkpointing module sees it:
    everything is Megatron-core's, except that ``save`` also writes the manifest."""

    def __init__(self, package: Any) -> None:
        self.__wrapped__ = package

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def save(self, sharded_state_dict, checkpoint_dir: str, *args, **kwargs):
        """Megatron-core's ``save``, then (collectively) the manifest, written last."""
        if "verify_integrity" in kwargs:
            kwargs["verify_integrity"] = False  # our manifest replaces Megatron's rank-0 one
        request = self.__wrapped__.save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if request is None:
            write_manifest(str(checkpoint_dir))
        else:
            request.add_finalize_fn(lambda: write_manifest(str(checkpoint_dir)))
        return request


def _manifest_stamp(checkpoint_dir: str) -> Tuple[int, int]:
    stat = os.stat(os.path.join(checkpoint_dir, MANIFEST))
    return stat.st_mtime_ns, stat.st_size


def verify_before_read(checkpoint_dir: str, first_read: bool) -> None:
    """Verify ``checkpoint_dir`` before Megatron-LM reads it.

    Megatron-LM's ``load_checkpoint`` reads a torch_dist checkpoint twice: its common state
    (``rank0=True``: ``first_read``), then the tensors. The first read verifies and leaves a
    stamp of the manifest it verified; the second consumes the stamp instead of hashing
    everything again (and verifies when there is none). Collective when torch.distributed
    is initialized; without it (Megatron-LM reading the checkpoint's arguments before the
    process group exists) nothing is checked here.
    """
    if not dist.is_initialized():
        return
    checkpoint_dir = str(checkpoint_dir)
    if not has_manifest(checkpoint_dir):
        if dist.get_rank() == 0:
            logger.warning("%s has no %s: loading it unverified (saved without megatron_muon)", checkpoint_dir, MANIFEST)
        return
    stamp = _manifest_stamp(checkpoint_dir)
    if not first_read and _VERIFIED.pop(checkpoint_dir, None) == stamp:
        return
    verify_manifest(checkpoint_dir)
    if first_read:
        _VERIFIED[checkpoint_dir] = stamp


def _wrap_load_global_dist_base_checkpoint(original: Callable, checkpointing: Any) -> Callable:
    def load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release,
                                         *rest, **kwargs):
        checkpoint_dir = checkpointing.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        verify_before_read(checkpoint_dir, first_read=bool(rank0))
        return original(load_dir, args, rank0, sharded_state_dict, iteration, release, *rest, **kwargs)

    load_global_dist_base_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return load_global_dist_base_checkpoint


def integrity_patches(checkpointing: Optional[Any] = None) -> List[Tuple[Any, str, Any, Any]]:
    """``(module, name, original, wrapper)`` for the save and load points of Megatron-LM's
    ``megatron.training.checkpointing`` (empty when Megatron-LM is not importable)."""
    if checkpointing is None:
        try:
            import megatron.training.checkpointing as checkpointing
        except ImportError:
            return []
    patches = []
    package = getattr(checkpointing, "dist_checkpointing", None)
    if package is not None and not isinstance(package, DistCheckpointingWithManifest):
        patches.append((checkpointing, "dist_checkpointing", package, DistCheckpointingWithManifest(package)))
    load = getattr(checkpointing, "_load_global_dist_base_checkpoint", None)
    if load is not None and not hasattr(load, "__wrapped__"):
        patches.append((checkpointing, "_load_global_dist_base_checkpoint", load,
                        _wrap_load_global_dist_base_checkpoint(load, checkpointing)))
    return patches
