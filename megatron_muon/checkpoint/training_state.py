"""Whole training states (model, optimizer, extra objects) as torch_dist checkpoints, for a
training loop of your own: :func:`save_checkpoint` and :func:`load_checkpoint`.

Saving goes through :func:`publish.publish` (staged, manifest last, verified when it
replaces a checkpoint, swapped into place). Loading verifies the manifest on all ranks
before anything is unpickled, then reads through the restricted unpickler
(:mod:`.unpickling`), and refuses optimizer state that is not ours or lacks a state this run
needs (:func:`optimizer_state.require_ours`, :func:`optimizer_state.states_to_load`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from .errors import CheckpointError, ReadStopped, checkpoint_error_in
from .integrity import verify_manifest
from .optimizer_state import READ_ERRORS, require_ours, saved_keys, states_to_load, unused_state_prefixes
from .publish import publish, resolve_checkpoint_dir
from .reading import restricted_reading
from .torch_dist import TORCH_DIST, keep_states, requested_keys


def model_sharded_state_dict(model: List[torch.nn.Module]) -> Dict[str, Any]:
    """The model's own sharded state dict (of the modules under the DDP wrappers)."""
    from ..matrices import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def save_checkpoint(
    checkpoint_dir: str, model: List[torch.nn.Module], optimizer, extra: Optional[Dict[str, Any]] = None
) -> None:
    """Save model + optimizer (+ ``extra`` common objects) as a torch_dist checkpoint.

    Written to ``<checkpoint_dir>.tmp`` first; once all ranks finished, the checksum
    manifest is written (last) and the directory is swapped into place, so a failed or
    interrupted save leaves the previous checkpoint intact (the failure propagates to the
    caller, on every rank). Collective: call on every rank."""
    from megatron.core import dist_checkpointing

    model_sd = model_sharded_state_dict(model)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd), "extra": extra or {}}
    publish(checkpoint_dir, lambda staging: dist_checkpointing.save(state, staging))


def read_common(checkpoint_dir: str) -> Dict[str, Any]:
    """The common (non-tensor) state of the torch_dist checkpoint ``checkpoint_dir``, without
    loading any tensor, through the restricted unpickler."""
    return TORCH_DIST.read_common(checkpoint_dir)


def load_checkpoint(
    checkpoint_dir: str, model: List[torch.nn.Module], optimizer, load_optimizer: bool = True
) -> Dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizer`` (any parallel
    layout, any expert layout Megatron's model state dict can reshard). Returns ``extra``.
    ``load_optimizer=False`` loads the weights only and resets the optimizer's fp32 masters
    from them.

    Before anything is read, every file is checked against the checkpoint's manifest (the
    work split over ranks): a changed, truncated, missing or unlisted file raises
    ``CheckpointIntegrityError`` on every rank, naming the file and tensor. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from ..matrices import unwrap

    checkpoint_dir = resolve_checkpoint_dir(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a checkpoint directory")
    verify_manifest(checkpoint_dir)
    common = read_common(checkpoint_dir)
    if load_optimizer:
        require_ours(common.get("optimizer"), checkpoint_dir)
    model_sd = model_sharded_state_dict(model)
    state: Dict[str, Any] = {"model": model_sd, "extra": {}}
    if load_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
        saved = saved_keys(checkpoint_dir)
        param_state = state["optimizer"]["param_state"]
        keep_states(param_state, states_to_load(requested_keys(param_state), saved, checkpoint_dir))
    try:
        # Megatron's names: "missing" = in the checkpoint, requested by no rank;
        # "unexpected" = requested here, absent from the checkpoint.
        with restricted_reading():
            loaded, unused, absent = dist_checkpointing.load(state, checkpoint_dir, strict=StrictHandling.RETURN_ALL)
    except (ReadStopped, *READ_ERRORS) as e:
        raise checkpoint_error_in(e) or CheckpointError(
            f"loading {checkpoint_dir} failed: {e}. If shapes differ, the model config differs from "
            "the one the checkpoint was saved with (compare with tools/convert_checkpoint.py inspect)."
        ) from e
    # Layers of one expert layout keep an `_extra_state` another layout never wrote (it
    # holds no weights); anything else absent or unused means a different model or optimizer.
    absent = sorted(k for k in absent if "_extra_state" not in k)
    if absent:
        raise CheckpointError(
            f"{checkpoint_dir} lacks {len(absent)} tensors this model and optimizer need, e.g. "
            f"{absent[:3]}: the checkpoint was saved for a different model config or optimizer."
        )
    # Optimizer states of the checkpoint's run this run does not use (variance reduction switched off).
    skipped = ("_extra_state",) + (unused_state_prefixes(optimizer.config) if load_optimizer else ("optimizer.",))
    unused = sorted(k for k in unused if not any(s in k for s in skipped))
    if unused:
        raise CheckpointError(
            f"{checkpoint_dir} holds {len(unused)} tensors this model and optimizer do not have, e.g. "
            f"{unused[:3]}: the checkpoint was saved for a different model config or optimizer."
        )
    for i, chunk in enumerate(model):
        result = unwrap(chunk).load_state_dict(loaded["model"][f"model{i}"], strict=False)
        unknown = [k for k in list(result.missing_keys) + list(result.unexpected_keys) if "_extra_state" not in k]
        if unknown:
            raise CheckpointError(f"model chunk {i} does not match {checkpoint_dir}: {unknown[:3]}")
    if load_optimizer:
        TORCH_DIST.load_state_dict(optimizer, loaded["optimizer"])
    else:
        optimizer.reload_model_params()
    return dict(common.get("extra", {}))
