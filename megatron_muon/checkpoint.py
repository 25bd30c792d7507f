"""Reshardable checkpoints of the Muon optimizer in Megatron ``dist_checkpointing`` (torch_dist).

Every optimizer state tensor is saved in *model coordinates*: for each model parameter,
the fp32 master weight (``param``), and either its Muon momentum (``momentum_buffer``) or
its AdamW moments (``exp_avg``, ``exp_avg_sq``), each with the shape of the parameter and
exactly the parameter's own sharding metadata (global key, global offsets, TP/PP/EP
fragmentation, GLU and expert factories, replica ids). So whatever layouts Megatron can
reshard the model between (TP, PP, EP, expert-TP, DP, the expert storage layouts), it
reshards the optimizer state between too; logical matrices are subsets of parameters and
follow. The key names are Megatron's ``fully_reshardable`` names
(``optimizer.state.<state>.<param key>``), so a Megatron AdamW checkpoint differs from
ours only in which state keys exist (``tools/convert_checkpoint.py`` converts).

Saving: each rank all-gathers, over its data-parallel group, the distributed-optimizer
shards of every bucket, so it holds its TP-local parameters' full state; Megatron then
writes one copy (replica ids). Loading: each rank reads its TP-local parameters' state
and keeps the byte range its DP shard owns; no dummy step is needed.

``save_checkpoint`` / ``load_checkpoint`` write and read a whole training state (model,
optimizer, extra objects) atomically: everything goes to a temporary directory, gets a
checksum manifest (``megatron_muon.integrity``) once every rank finished writing, and is
renamed into place; loading verifies the manifest on all ranks before reading anything,
and falls back to ``<dir>.old`` when a re-save was interrupted between its two renames.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api

from .integrity import CheckpointIntegrityError, has_manifest, verify_manifest, write_manifest

logger = logging.getLogger(__name__)

FORMAT = "megatron_muon/1"
# torch's distributed-checkpoint errors derive from BaseException, not Exception.
_READ_ERRORS = (Exception, torch.distributed.checkpoint.api.CheckpointException)
MUON_KEYS = ("momentum_buffer",)
SECOND_MOMENT = "second_moment"
"""Variance reduction's factored second moment, saved expanded to the parameter's shape
(each element holds its row's or column's value) so that it reshards like the rest."""
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix."""


__all__ = ["CheckpointError", "CheckpointIntegrityError", "save_checkpoint", "load_checkpoint", "resolve_checkpoint_dir"]


# ---------------------------------------------------------------------------------------
# Optimizer state <-> model-coordinate tensors
# ---------------------------------------------------------------------------------------


def _model_param_metadata(model_sharded_state_dict) -> Dict[int, Any]:
    """id(param) -> its ShardedTensor / ShardedTensorFactory in the model's state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for value in nested_values(model_sharded_state_dict):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None:
            out[id(value.data)] = value
    return out


def _state_keys(opt, param) -> tuple:
    if id(param) not in opt.muon_param_ids:
        return ("param",) + ADAM_KEYS
    return ("param",) + MUON_KEYS + ((SECOND_MOMENT,) if opt.second_moments is not None else ())


def _expanded_second_moments(opt) -> Dict[int, torch.Tensor]:
    """id(master shard) -> this rank's piece of the expanded second moment (collective
    over the orthogonalization group: the owners scatter them)."""
    if opt.second_moments is None:
        return {}
    pieces = opt.second_moments.expanded_shards(opt.pipeline, opt._shards)
    return {id(main): piece for main, piece in zip(opt._shards, pieces) if main is not None}


def _local_state(opt, param, key: str, derived: Optional[Dict[int, torch.Tensor]] = None) -> Optional[torch.Tensor]:
    """This rank's 1-D shard of one state of ``param`` (zeros if not yet allocated);
    ``derived``: states not kept per shard (the expanded second moments), by id(main)."""
    held = opt.shard_of(param)
    if held is None:
        return None
    main, _, _ = held
    if key == "param":
        return main
    if key == SECOND_MOMENT:
        return derived[id(main)]
    state = opt.optimizer.state.get(main, {})
    value = state.get(key)
    return value if value is not None else torch.zeros_like(main, dtype=torch.float32)


@torch.no_grad()
def gather_full_states(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    """Every param of ``opt``'s buffers -> {state key: full TP-local tensor}, all-gathered
    over the data-parallel group bucket by bucket (one collective per bucket and key)."""
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    derived = _expanded_second_moments(opt)
    for gbuf_idx, buffer in enumerate(opt.buffers):
        group = buffer.data_parallel_group
        size = group.size()
        (ranges,) = opt.gbuf_ranges[gbuf_idx].values()
        for bucket_idx, bucket in enumerate(buffer.buckets):
            numel = bucket.grad_data.numel()
            param_map = ranges[bucket_idx]["param_map"]
            keys = sorted({k for p in bucket.params_list for k in _state_keys(opt, p)})
            for key in keys:
                local = torch.zeros(numel // size, dtype=torch.float32, device=bucket.grad_data.device)
                for param, rng in param_map.items():
                    if key in _state_keys(opt, param):
                        local[rng["gbuf_local"].start : rng["gbuf_local"].end] = _local_state(opt, param, key, derived)
                world = torch.empty(numel, dtype=torch.float32, device=local.device)
                if size > 1:
                    dist.all_gather_into_tensor(world, local, group=group)
                else:
                    world.copy_(local)
                for param in bucket.params_list:
                    if key not in _state_keys(opt, param):
                        continue
                    start, end, _ = buffer.param_index_map[param]
                    full = world[start - bucket.offset : end - bucket.offset]
                    out.setdefault(id(param), {})[key] = full.view(param.shape).clone()
    return out


def _params_in_order(opt):
    """(python key, param) for every param of ``opt``'s buffers, in a fixed order.

    The python keys only need to match between ``optimizer_sharded_state`` and
    ``load_optimizer_state`` of the same process (the checkpoint itself is keyed by
    ``ShardedTensor.key`` and offsets), so the buffer position is enough."""
    i = 0
    for buffer in opt.buffers:
        for param in buffer.param_index_map:
            yield f"{opt.name}.{i}", param
            i += 1


def optimizer_sharded_state(opt, model_sharded_state_dict, is_loading: bool) -> Dict[str, Dict[str, Any]]:
    """``{python key: {state key: ShardedTensor(-Factory)}}`` for one MuonDistributedOptimizer."""
    metadata = _model_param_metadata(model_sharded_state_dict)
    full = {} if is_loading else gather_full_states(opt)
    out: Dict[str, Dict[str, Any]] = {}
    for name, param in _params_in_order(opt):
        sh = metadata.get(id(param))
        if sh is None:
            raise CheckpointError(
                f"A parameter of shape {tuple(param.shape)} is missing from the model's "
                "sharded_state_dict; build it with model.sharded_state_dict() (keep_vars) "
                "from the same model chunks the optimizer was built for."
            )
        entry = {}
        for key in _state_keys(opt, param):
            data = (
                torch.empty(param.shape, dtype=torch.float32, device=param.device)
                if is_loading
                else full[id(param)][key]
            )
            kwargs = dict(key=f"optimizer.state.{key}.{sh.key}", data=data)
            if hasattr(sh, "dtype"):
                kwargs["dtype"] = torch.float32
            entry[key] = replace(sh, **kwargs)
        out[name] = entry
    return out


@torch.no_grad()
def load_optimizer_state(opt, param_state: Dict[str, Dict[str, torch.Tensor]], step: int) -> None:
    """Put loaded model-coordinate tensors back into ``opt``'s shards and optimizer state
    (collective over the orthogonalization group with variance reduction: the owners
    gather their matrices' second moments)."""
    second_moments: Dict[int, torch.Tensor] = {}
    for name, param in _params_in_order(opt):
        held = opt.shard_of(param)
        if held is None:
            continue
        main, start, end = held
        tensors = param_state[name]
        state = opt.optimizer.state[main]
        for key in _state_keys(opt, param):
            if key == SECOND_MOMENT and key not in tensors:
                continue  # saved without variance reduction: the second moments start at 0
            flat = tensors[key].reshape(-1)[start:end].to(main.device)
            if key == "param":
                main.copy_(flat)
            elif key == SECOND_MOMENT:
                second_moments[id(main)] = flat.clone()
            else:
                state[key] = flat.clone()
        state["step"] = torch.tensor(float(step))
    if opt.second_moments is not None:
        saved = any(SECOND_MOMENT in param_state[name] for name, _ in _params_in_order(opt))
        if saved:  # the same answer on every rank: it comes from the checkpoint's common state
            shards = [second_moments.get(id(m)) if m is not None else None for m in opt._shards]
            opt.second_moments.load_expanded_shards(opt.pipeline, shards)
        else:
            opt.second_moments.state.clear()
    opt.state_loaded()


# ---------------------------------------------------------------------------------------
# Whole training states, atomically
# ---------------------------------------------------------------------------------------


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    checkpoint_dir: str,
    model: List[torch.nn.Module],
    optimizer,
    extra: Optional[Dict[str, Any]] = None,
    per_rank: Any = None,
) -> None:
    """Save model + optimizer (+ ``extra`` common objects) as a torch_dist checkpoint.

    ``per_rank``: an object each rank saves for itself (e.g. its RNG states), read back by
    ``load_checkpoint(..., per_rank=True)`` only at the same world size.

    Written to ``<checkpoint_dir>.tmp`` first; once all ranks finished, the checksum
    manifest is written (last) and the directory is renamed into place, so a failed or
    interrupted save leaves the previous checkpoint intact (the failure propagates to the
    caller). Between the two renames of the swap the previous checkpoint sits at
    ``<checkpoint_dir>.old``; ``load_checkpoint`` falls back to it (see
    ``resolve_checkpoint_dir``). Collective: call on every rank.
    """
    from megatron.core import dist_checkpointing

    tmp = checkpoint_dir.rstrip("/") + ".tmp"
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd = _model_sharded_state_dict(model)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd), "extra": extra or {}}
    state["world_size"] = dist.get_world_size()
    if per_rank is not None:
        state["per_rank"] = _per_rank_object(per_rank)
    # A failure raises here (on the failing rank; the others fail in the next collective);
    # nothing has touched checkpoint_dir yet.
    dist_checkpointing.save(state, tmp)
    _barrier()
    write_manifest(tmp)  # collective; ends with a barrier
    if _rank0():
        old = checkpoint_dir.rstrip("/") + ".old"
        if os.path.exists(checkpoint_dir):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(checkpoint_dir, old)
        os.rename(tmp, checkpoint_dir)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _per_rank_object(value: Any):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("per_rank_state", value, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _model_sharded_state_dict(model: List[torch.nn.Module]) -> Dict[str, Any]:
    """The model's own sharded state dict (of the modules under the DDP wrappers)."""
    from .matrices import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def resolve_checkpoint_dir(checkpoint_dir: str) -> str:
    """The directory to load for ``checkpoint_dir``: itself when it is complete (has its
    manifest); ``<checkpoint_dir>.old`` when a re-save was interrupted between moving the
    previous checkpoint aside and moving the new one in (the directory is then missing, or
    incomplete); otherwise ``checkpoint_dir`` itself, whose verification then reports what is
    wrong."""
    base = checkpoint_dir.rstrip("/")
    old = base + ".old"
    if not has_manifest(base) and has_manifest(old):
        if _rank0():
            logger.warning("%s is missing or incomplete (an interrupted re-save); loading %s instead", base, old)
        return old
    return checkpoint_dir


def read_common(checkpoint_dir: str) -> Dict[str, Any]:
    """The checkpoint's common (non-tensor) state, without loading any tensor."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a checkpoint directory")
    try:
        return dist_checkpointing.load_common_state_dict(checkpoint_dir)
    except _READ_ERRORS as e:  # any unreadable file is the same user error
        raise CheckpointError(f"{checkpoint_dir} is not a readable torch_dist checkpoint: {e}") from e


def _has_second_moments(common: Dict[str, Any]) -> bool:
    """Whether the checkpoint was saved with variance reduction on (so holds second moments)."""
    opt = common.get("optimizer")
    config = opt.get("muon_config", {}) if isinstance(opt, dict) else {}
    return config.get("muon_variance_reduction") is not None


def load_checkpoint(
    checkpoint_dir: str,
    model: List[torch.nn.Module],
    optimizer,
    load_optimizer: bool = True,
    per_rank: bool = False,
) -> Dict[str, Any]:
    """Load what ``save_checkpoint`` wrote into ``model`` and ``optimizer`` (any parallel
    layout, any expert layout Megatron's model state dict can reshard). Returns ``extra``,
    plus ``extra["per_rank"]`` with ``per_rank=True`` when the checkpoint was saved by as
    many ranks as load it (``None`` otherwise). ``load_optimizer=False`` loads the weights
    only and resets the optimizer's fp32 masters from them.

    Before anything is read, every file is checked against the checkpoint's manifest (the
    work split over ranks): a changed, truncated or missing file raises
    ``CheckpointIntegrityError`` on every rank, naming the file and tensor. Collective."""
    from megatron.core import dist_checkpointing

    checkpoint_dir = resolve_checkpoint_dir(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a checkpoint directory")
    verify_manifest(checkpoint_dir)
    common = read_common(checkpoint_dir)
    kind = common.get("optimizer", {}).get("format") if isinstance(common.get("optimizer"), dict) else None
    if kind != FORMAT and load_optimizer:
        hint = (
            "It was written by Megatron's own optimizer; convert it with "
            "`python tools/convert_checkpoint.py adam-to-muon`."
            if isinstance(common.get("optimizer"), dict) and "param_state_sharding_type" in common["optimizer"]
            else "It was not written by megatron_muon."
        )
        raise CheckpointError(f"{checkpoint_dir} holds no Muon optimizer state (format {kind!r}). {hint}")
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from .matrices import unwrap

    model_sd = _model_sharded_state_dict(model)
    state: Dict[str, Any] = {"model": model_sd, "extra": {}}
    if load_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
        if not _has_second_moments(common):
            for entry in state["optimizer"]["param_state"].values():
                entry.pop(SECOND_MOMENT, None)  # variance reduction turned on: they start at 0
    same_world = common.get("world_size") == dist.get_world_size()
    if per_rank and same_world:
        state["per_rank"] = _per_rank_object(None)
    try:
        # Megatron's names: "missing" = in the checkpoint, requested by no rank;
        # "unexpected" = requested here, absent from the checkpoint.
        loaded, unused, absent = dist_checkpointing.load(state, checkpoint_dir, strict=StrictHandling.RETURN_ALL)
    except _READ_ERRORS as e:
        raise CheckpointError(
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
    # Second moments of a run with variance reduction are simply not used when it is off.
    skipped = ("_extra_state", "per_rank_state", f"optimizer.state.{SECOND_MOMENT}.") + (
        () if load_optimizer else ("optimizer.",)
    )
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
        optimizer.load_sharded(loaded["optimizer"])
    else:
        optimizer.reload_model_params()
    extra = dict(common.get("extra", {}))
    if per_rank:
        extra["per_rank"] = loaded.get("per_rank") if same_world else None
    return extra
