"""Checksummed checkpoints inside Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint``.

The save wrapper writes the manifest (``megatron_muon.integrity``) once every rank has
finished writing, before Megatron-LM moves its tracker file; the load wrapper verifies it on
every rank before the first read. docs/design.md ("Inside Megatron-LM") says where each
hooks in. :func:`integrity_patches` returns them in the form ``use_megatron_muon`` installs.
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
            # Finalize steps run in order, before Megatron-LM's own that moves the tracker file.
            request.add_finalize_fn(lambda: write_manifest(str(checkpoint_dir)))
        return request


def _manifest_stamp(checkpoint_dir: str) -> Tuple[int, int]:
    stat = os.stat(os.path.join(checkpoint_dir, MANIFEST))
    return stat.st_mtime_ns, stat.st_size


def verify_before_read(checkpoint_dir: str, first_read: bool) -> None:
    """Verify ``checkpoint_dir`` (collectively) before Megatron-LM reads it.

    Megatron-LM reads a torch_dist checkpoint twice, the common state (``first_read``) and
    then the tensors; the second read skips the hashing if the manifest verified by the first
    is unchanged. Before the process group exists (Megatron-LM reading the checkpoint's
    arguments) nothing is checked."""
    if not dist.is_initialized():
        return
    checkpoint_dir = str(checkpoint_dir)
    if not has_manifest(checkpoint_dir):
        if dist.get_rank() == 0:
            logger.warning(
                "%s has no %s: loading it unverified (saved without megatron_muon)", checkpoint_dir, MANIFEST
            )
        return
    stamp = _manifest_stamp(checkpoint_dir)
    if not first_read and _VERIFIED.pop(checkpoint_dir, None) == stamp:
        return
    verify_manifest(checkpoint_dir)
    if first_read:
        _VERIFIED[checkpoint_dir] = stamp


def _wrap_load_global_dist_base_checkpoint(original: Callable, checkpointing: Any) -> Callable:
    def load_global_dist_base_checkpoint(
        load_dir, args, rank0, sharded_state_dict, iteration, release, *rest, **kwargs
    ):
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
        patches.append(
            (
                checkpointing,
                "_load_global_dist_base_checkpoint",
                load,
                _wrap_load_global_dist_base_checkpoint(load, checkpointing),
            )
        )
    return patches
