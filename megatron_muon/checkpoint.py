"""Reshardable checkpoints of the Muon optimizer in Megatron ``dist_checkpointing`` (torch_dist).

Every optimizer state tensor is saved in *model coordinates*: for each model parameter,
its fp32 master weight (``param``) and its states (the registry's, ``state.MUON_STATES``,
for a Muon matrix: ``momentum_buffer``, with variance reduction ``second_moment``; AdamW's
``exp_avg``, ``exp_avg_sq`` for the others), each with the shape of the parameter and
exactly the parameter's own sharding metadata (global key, global offsets, TP/PP/EP
fragmentation, GLU and expert factories, replica ids). So whatever layouts Megatron can
reshard the model between (TP, PP, EP, expert-TP, DP, the expert storage layouts), it
reshards the optimizer state between too; logical matrices are subsets of parameters and
follow. The key names are Megatron's ``fully_reshardable`` names
(``optimizer.state.<state>.<param key>``), so a Megatron AdamW checkpoint differs from
ours only in which state keys exist (``tools/convert_checkpoint.py`` converts).

Saving: states kept per logical matrix on its owner are first expanded to the matrix and
cut to the holders of its pieces (the step's own scatter, in fp32); then each rank
all-gathers, over its data-parallel group, the shards of every bucket, so it holds its
TP-local parameters' full state; Megatron writes one copy (replica ids). Loading: each
rank reads its TP-local parameters' state and keeps its master's range; owner-kept states
travel back to the (possibly different) owners. A state the checkpoint lacks (switched on
since) starts at zero; one it holds but the run does not use is ignored.

``save_checkpoint`` / ``load_checkpoint`` write and read a whole training state (model,
optimizer, extra objects) atomically: everything goes to a temporary directory, gets a
checksum manifest (``megatron_muon.integrity``) once every rank finished writing, and is
swapped into place (:func:`swap_into_place`, also used by Megatron-LM's save path);
loading verifies the manifest on all ranks before reading anything, and falls back to
``<dir>.old`` when a re-save was interrupted between the two renames of a filesystem that
cannot exchange directories atomically.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import shutil
import types
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api

from .integrity import CheckpointIntegrityError, has_manifest, verify_manifest, write_manifest
from .pipeline import gather_matrices, scatter_matrices
from .state import ADAM_STATES, MUON_STATES, muon_states

logger = logging.getLogger(__name__)

FORMAT = "megatron_muon/1"
# torch's distributed-checkpoint errors derive from BaseException, not Exception.
_READ_ERRORS = (Exception, torch.distributed.checkpoint.api.CheckpointException)
STATE_PREFIX = "optimizer.state."


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix."""


__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint_dir",
]


# ---------------------------------------------------------------------------------------
# Optimizer state <-> model-coordinate tensors
# ---------------------------------------------------------------------------------------


def state_key(state: str, model_key: str) -> str:
    """The checkpoint key of one optimizer state of one model tensor."""
    return f"{STATE_PREFIX}{state}.{model_key}"


def state_names(opt, param) -> Tuple[str, ...]:
    """The states a checkpoint holds for ``param`` of one optimizer: its fp32 master
    (``param``), then the registry's enabled states (Muon matrix) or AdamW's."""
    if id(param) in opt.muon_param_ids:
        return ("param",) + tuple(s.name for s in muon_states(opt.config))
    return ("param",) + ADAM_STATES


def saved_config(common: Dict[str, Any]) -> types.SimpleNamespace:
    """The MuonConfig settings a checkpoint was saved with (defaults where it says nothing,
    as in a checkpoint converted from AdamW)."""
    from .config import MuonConfig

    defaults = {f.name: f.default for f in dataclasses.fields(MuonConfig) if f.default is not dataclasses.MISSING}
    opt = common.get("optimizer")
    saved = opt.get("muon_config", {}) if isinstance(opt, dict) else {}
    return types.SimpleNamespace(**{**defaults, **saved})


def _model_param_metadata(model_sharded_state_dict) -> Dict[int, Any]:
    """id(param) -> its ShardedTensor / ShardedTensorFactory in the model's state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for value in nested_values(model_sharded_state_dict):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None:
            out[id(value.data)] = value
    return out


@torch.no_grad()
def shard_values(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    """id(param) -> {state: this rank's 1-D range of it} for every param whose master this
    rank holds (zeros for a state not allocated yet). Collective over the orthogonalization
    group when there are owner-kept states: the owners scatter them, expanded."""
    owner_kept = [s.name for s in muon_states(opt.config, "owner")]
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for shard in opt.shard_map:
        if shard.master is None:
            continue
        state = opt.optimizer.state.get(shard.master, {})
        values = out[id(shard.param)] = {}
        for name in state_names(opt, shard.param):
            value = shard.master if name == "param" else state.get(name) if name not in owner_kept else None
            values[name] = value if value is not None else torch.zeros_like(shard.master, dtype=torch.float32)
    step = opt.muon
    for name in owner_kept:
        for msg in step.messages:
            expanded = [step.owner_states.expanded(name, job, step.device) for job in msg.owned]
            for (p, start, end), piece in scatter_matrices(step, msg, expanded):
                out[id(opt.muon_params[p].param)][name][start:end] = piece
    return out


@torch.no_grad()
def gather_full_states(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    """Every param of ``opt``'s buffers -> {state: full TP-local tensor}, all-gathered
    over the data-parallel group bucket by bucket (one collective per bucket and state)."""
    local = shard_values(opt)
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for buffer in opt.shard_map.buffers:
        group = buffer.data_parallel_group
        size = group.size()
        for bucket in buffer.buckets:
            numel = bucket.grad_data.numel()
            shard_start = group.rank() * (numel // size)
            names = sorted({n for p in bucket.params_list for n in state_names(opt, p)})
            for name in names:
                mine = torch.zeros(numel // size, dtype=torch.float32, device=bucket.grad_data.device)
                for param in bucket.params_list:
                    shard = opt.shard_map[param]
                    if shard.master is None or name not in state_names(opt, param):
                        continue
                    start = buffer.param_index_map[param][0] - bucket.offset + shard.start - shard_start
                    mine[start : start + shard.end - shard.start] = local[id(param)][name]
                world = torch.empty(numel, dtype=torch.float32, device=mine.device)
                if size > 1:
                    dist.all_gather_into_tensor(world, mine, group=group)
                else:
                    world.copy_(mine)
                for param in bucket.params_list:
                    if name in state_names(opt, param):
                        start, end, _ = buffer.param_index_map[param]
                        full = world[start - bucket.offset : end - bucket.offset]
                        out.setdefault(id(param), {})[name] = full.view(param.shape).clone()
    return out


def params_in_order(opt) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(python key, param) for every param of ``opt``'s buffers, in a fixed order.

    The python keys only need to match between saving and loading in the same process
    (the checkpoint itself is keyed by ``ShardedTensor.key`` and offsets), so the buffer
    position is enough."""
    for i, param in enumerate(opt.shard_map.params):
        yield f"{opt.name}.{i}", param


def _sharded_param_state(opt, model_sharded_state_dict, is_loading: bool) -> Dict[str, Dict[str, Any]]:
    """``{python key: {state: ShardedTensor(-Factory)}}`` for one MuonDistributedOptimizer."""
    metadata = _model_param_metadata(model_sharded_state_dict)
    full = {} if is_loading else gather_full_states(opt)
    out: Dict[str, Dict[str, Any]] = {}
    for name, param in params_in_order(opt):
        sh = metadata.get(id(param))
        if sh is None:
            raise CheckpointError(
                f"A parameter of shape {tuple(param.shape)} is missing from the model's "
                "sharded_state_dict; build it with model.sharded_state_dict() (keep_vars) "
                "from the same model chunks the optimizer was built for."
            )
        entry = {}
        for key in state_names(opt, param):
            data = (
                torch.empty(param.shape, dtype=torch.float32, device=param.device)
                if is_loading
                else full[id(param)][key]
            )
            kwargs = dict(key=state_key(key, sh.key), data=data)
            if hasattr(sh, "dtype"):
                kwargs["dtype"] = torch.float32
            entry[key] = replace(sh, **kwargs)
        out[name] = entry
    return out


def common_state(step: int, optimizers: Dict[str, Any], muon_config: Dict[str, Any]) -> Dict[str, Any]:
    """The non-tensor part of a Muon optimizer checkpoint, the one schema (the converter
    writes it too): format, successful steps, each optimizer's grad scaler and parameter
    groups (``MuonDistributedOptimizer.common_state``), the ``MuonConfig`` settings saved."""
    return {"format": FORMAT, "step": step, "optimizers": optimizers, "muon_config": muon_config}


def optimizer_sharded_state(chain, model_sharded_state_dict, is_loading: bool) -> Dict[str, Any]:
    """The ``MuonChainedOptimizer``'s whole sharded state (``sharded_state_dict``)."""
    param_state: Dict[str, object] = {}
    for opt in chain.muon_optimizers:
        param_state.update(_sharded_param_state(opt, model_sharded_state_dict, is_loading))
    return dict(chain_common_state(chain), param_state=param_state)


def chain_common_state(chain) -> Dict[str, Any]:
    """:func:`common_state` of a ``MuonChainedOptimizer``."""
    settings = {
        k: (str(v) if isinstance(v, torch.dtype) else v)
        for k, v in vars(chain.config).items()
        if (k.startswith("muon_") or k in ("lr", "min_lr", "weight_decay", "clip_grad", "bf16", "fp16"))
        and not callable(v)
    }
    optimizers = {opt.name: opt.common_state() for opt in chain.muon_optimizers}
    return common_state(chain.num_steps, optimizers, settings)


def require_ours(common: Any) -> None:
    """Refuse optimizer state whose common part (:func:`common_state`) is not ours."""
    if not (isinstance(common, dict) and common.get("format") == FORMAT):
        raise CheckpointError(
            "This optimizer state was not written by megatron_muon (for a Megatron AdamW checkpoint, "
            "convert it with tools/convert_checkpoint.py adam-to-muon)."
        )


@torch.no_grad()
def load_optimizer_state(chain, state_dict: Dict[str, Any]) -> None:
    """Load what ``dist_checkpointing.load`` returned for :func:`optimizer_sharded_state`
    into the chained optimizers (collective over each orthogonalization group when there
    are owner-kept states: the holders send their pieces to the new owners)."""
    require_ours(state_dict)
    chain.num_steps = int(state_dict["step"])
    commons = state_dict["optimizers"]
    for opt in chain.muon_optimizers:
        load_param_state(opt, state_dict["param_state"], chain.num_steps)
        opt.load_common_state(commons.get(opt.name) or commons["dense"])


def load_param_state(opt, param_state: Dict[str, Dict[str, torch.Tensor]], step: int, local: bool = False) -> None:
    """Set ``opt``'s masters and states from ``param_state`` (python key -> {state: tensor}):
    whole TP-local tensors of which this rank keeps its range, or with ``local`` this rank's
    range already (Megatron-FSDP shards)."""
    owner_kept = {s.name: {} for s in muon_states(opt.config, "owner")}
    for name, param in params_in_order(opt):
        shard = opt.shard_map[param]
        if shard.master is None:
            continue
        tensors = param_state[name]
        state = opt.optimizer.state[shard.master]
        for key in state_names(opt, param):
            if key not in tensors:
                continue  # saved without this state (switched on since): it starts at zero
            flat = tensors[key].reshape(-1)
            flat = (flat if local else flat[shard.start : shard.end]).to(shard.master.device)
            if key == "param":
                shard.master.copy_(flat)
            elif key in owner_kept:
                owner_kept[key][id(shard.master)] = flat.clone()
            else:
                state[key] = flat.clone()
        state["step"] = torch.tensor(float(step))
    step_state = opt.muon
    for key, pieces in owner_kept.items():
        step_state.owner_states.values[key].clear()
        if not any(key in param_state[name] for name, _ in params_in_order(opt)):
            continue  # the same answer on every rank: from the checkpoint's common state
        inputs = [pieces.get(id(m)) if m is not None else None for m in step_state.masters]
        for job, matrices in gather_matrices(step_state, inputs):
            step_state.owner_states.set_from_expanded(key, job, matrices)
    step_state.shard_states.adopt()


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
    manifest is written (last) and the directory is swapped into place
    (:func:`swap_into_place`), so a failed or interrupted save leaves the previous
    checkpoint intact (the failure propagates to the caller). Collective: call on every rank.
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
        swap_into_place(tmp, checkpoint_dir)
    _barrier()


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or filesystem has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_into_place(staging: str, target: str) -> None:
    """Move the complete checkpoint ``staging`` to ``target`` so that ``target`` always names a
    complete checkpoint: a new one is renamed in; an existing one is exchanged with it in one
    atomic step, then deleted. Where the filesystem cannot exchange, two renames (``target``
    to ``<target>.old``, ``staging`` to ``target``); between them ``<target>.old`` is the
    complete one (:func:`resolve_checkpoint_dir`, :func:`recover_interrupted_swap`). An empty
    ``target`` (a directory made for the save) is replaced. One process (rank 0) calls it."""
    target = target.rstrip("/")
    if os.path.isdir(target) and not os.listdir(target):
        os.rmdir(target)
    if not os.path.exists(target):
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)
    else:
        old = target + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(staging, target)
    shutil.rmtree(target + ".old", ignore_errors=True)  # also one an earlier interrupted swap left
    _fsync_dir(os.path.dirname(os.path.abspath(target)))


def recover_interrupted_swap(target: str) -> Optional[str]:
    """Undo what a killed :func:`swap_into_place` left at ``target``: the previous checkpoint
    back from ``<target>.old`` when ``target`` is missing, or ``<target>.old`` removed when
    ``target`` is complete. Returns a line saying what was done (None: nothing)."""
    target = target.rstrip("/")
    old = target + ".old"
    if not has_manifest(old):
        return None
    if not os.path.exists(target):
        os.rename(old, target)
        return f"{target}: an interrupted re-save left it at {old}; moved back"
    if has_manifest(target):
        shutil.rmtree(old)
        return f"{target}: removed {old}, the previous copy an interrupted re-save had replaced"
    return None


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
        saved = saved_config(common)
        for s in MUON_STATES:
            if not s.enabled(saved):  # switched on since: it starts at zero
                for entry in state["optimizer"]["param_state"].values():
                    entry.pop(s.name, None)
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
    # States of the checkpoint's run this run does not use (variance reduction switched off).
    unused_states = tuple(state_key(s.name, "") for s in MUON_STATES if not s.enabled(optimizer.config))
    skipped = ("_extra_state", "per_rank_state") + unused_states + (() if load_optimizer else ("optimizer.",))
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
        load_optimizer_state(optimizer, loaded["optimizer"])
    else:
        optimizer.reload_model_params()
    extra = dict(common.get("extra", {}))
    if per_rank:
        extra["per_rank"] = loaded.get("per_rank") if same_world else None
    return extra
