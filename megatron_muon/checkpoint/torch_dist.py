"""The ``torch_dist`` checkpoint format: Megatron-core's dist-checkpointing (a
``metadata.json`` beside torch DCP's files), which the DistributedOptimizer's runs write.

The optimizer's state is in model coordinates (:mod:`.optimizer_state`). Saving: each rank
writes only its own range of each parameter, as boxes of the parameter's global tensor
(``ranges.range_pieces``: uneven shards, no communication, no copy of the TP-local tensor),
owner-kept states first scattered to the holders of their pieces
(``optimizer_state.shard_values``). The data-parallel ranks hold different ranges, so each
is the writer of its own; replicas across TP (norms) are written once by Megatron's replica
ids. Loading: each rank asks for the same boxes of its own (possibly different) range,
which DCP reads from whatever chunks were written (a checkpoint of the first format holds
whole TP-local tensors; it loads the same way), straight into the tensor that holds it where
one does (:func:`load_targets`).

The converter reads a whole checkpoint with
every tensor at its full global shape in one process (one request per stored key, replica
0) and writes one the same way: Megatron-core then reshards it to whatever layout loads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Collection, Dict, Mapping, Tuple

import torch

from .errors import CheckpointError, ReadStopped, checkpoint_error_in
from .format import Checkpoint, CheckpointFormat, ConverterSupport
from .integrity import stored_format
from .optimizer_state import (
    READ_ERRORS,
    STATE_PREFIX,
    chain_common_state,
    held_in_place,
    load_param_state,
    megatron_parts,
    model_param_metadata,
    params_in_order,
    require_ours,
    shard_values,
    state_key,
    state_names,
)
from .ranges import RangePiece, range_pieces
from .reading import bounded, read_dcp_metadata, restricted_reading

_SHARD = re.compile(r"^(?P<key>.+)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")
"""A sharded object's stored key: its key, global offset and global shape."""


# ---------------------------------------------------------------------------------------
# The optimizer's state: each rank's own ranges
# ---------------------------------------------------------------------------------------

STATES = "states"
"""An entry's ``{state: [ShardedTensor of each box]}`` (absent where the rank holds none)."""
RANGES = "ranges"
"""An entry's :class:`Ranges` (not written: Megatron's ``LocalNonpersistentObject``)."""


@dataclass(frozen=True)
class Ranges:
    """What one parameter's entry asks for: each state's checkpoint key, and the boxes of
    this rank's range (``ranges.range_pieces``) that its ShardedTensors hold, in order."""

    keys: Dict[str, str]
    pieces: Tuple[RangePiece, ...]


def _ranges(entry: Dict[str, Any]) -> Ranges:
    """The :class:`Ranges` of an entry, before a load (wrapped) or after it."""
    ranges = entry[RANGES]
    return ranges.unwrap() if hasattr(ranges, "unwrap") else ranges


def requested_keys(param_state: Mapping[str, Dict[str, Any]]) -> Dict[str, Dict[str, str]]:
    """``{name: {state: checkpoint key}}`` of what a load of ``param_state`` asks for
    (:func:`states_to_load` decides which of them a checkpoint must hold)."""
    return {name: dict(_ranges(entry).keys) for name, entry in param_state.items()}


def keep_states(param_state: Dict[str, Dict[str, Any]], kept: Mapping[str, Collection[str]]) -> None:
    """Leave in ``param_state`` (a load's request) only the states ``kept`` names (also in
    its :class:`Ranges`, which say on every rank, holder or not, which states a load set)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    for name, states in kept.items():
        entry = param_state[name]
        ranges = _ranges(entry)
        keys = {s: key for s, key in ranges.keys.items() if s in states}
        entry[RANGES] = LocalNonpersistentObject(Ranges(keys, ranges.pieces))
        entry[STATES] = {s: v for s, v in entry.get(STATES, {}).items() if s in states}
        if not entry[STATES]:
            del entry[STATES]


def _sharded_param_state(opt, model_sharded_state_dict, is_loading: bool) -> Dict[str, Dict[str, Any]]:
    """``{python key: {"states": {state: [ShardedTensor]}, "ranges": Ranges}}`` for one
    MuonDistributedOptimizer: each state's boxes of this rank's range (module docstring)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    metadata = model_param_metadata(model_sharded_state_dict)
    values = load_targets(opt) if is_loading else shard_values(opt)
    out: Dict[str, Dict[str, Any]] = {}
    for name, param in params_in_order(opt):
        sh = metadata.get(id(param))
        if sh is None:
            raise CheckpointError(
                f"A parameter of shape {tuple(param.shape)} is missing from the model's "
                "sharded_state_dict; build it with model.sharded_state_dict() (keep_vars) "
                "from the same model chunks the optimizer was built for."
            )
        shard = opt.shard_map[param]
        pieces = tuple(range_pieces(sh, param.shape, shard.start, shard.end)) if shard.master is not None else ()
        names = state_names(opt, param)
        entry: Dict[str, Any] = {
            RANGES: LocalNonpersistentObject(Ranges({key: state_key(key, sh.key) for key in names}, pieces))
        }
        if pieces:
            entry[STATES] = {
                key: [
                    piece.sharded_tensor(
                        state_key(key, piece.placement.key),
                        piece.take(values[id(param)][key])
                        if key in values.get(id(param), {})
                        else torch.empty(piece.shape, dtype=torch.float32, device=param.device),
                    )
                    for piece in pieces
                ]
                for key in names
            }
        out[name] = entry
    return out


def load_targets(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    """id(param) -> {state: the tensor holding this rank's range of it} where one exists that
    a load can fill in place (the fp32 master, the per-shard states; not the owner-kept
    ones, which live per logical matrix): a box that is a contiguous run of it is read by
    DCP straight into it, so a load allocates nothing for it."""
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for shard, name, t in held_in_place(opt):
        mine = out.setdefault(id(shard.param), {})
        if t is not None and t.dtype == torch.float32 and t.is_contiguous() and t.numel() == shard.master.numel():
            mine[name] = t.view(-1)
    return out


def own_ranges(opt, param_state: Mapping[str, Dict[str, Any]]) -> Dict[str, Dict[str, torch.Tensor]]:
    """What a load of :func:`_sharded_param_state` returned, as ``{python key: {state: this
    rank's range of it, 1-D}}`` for :func:`load_param_state`: the load's targets
    (:func:`load_targets`), every box put in place (a no-op for one read in place)."""
    targets = load_targets(opt)
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, param in params_in_order(opt):
        entry = param_state[name]
        pieces = _ranges(entry).pieces
        shard = opt.shard_map[param]
        mine = out[name] = {}
        for key in _ranges(entry).keys:
            flat = targets.get(id(param), {}).get(key)
            if flat is None:
                flat = torch.empty(shard.end - shard.start if pieces else 0, dtype=torch.float32)
            mine[key] = flat
            for piece, value in zip(pieces, entry.get(STATES, {}).get(key, ()), strict=True):
                piece.put(flat, value)
    return out


def optimizer_sharded_state(chain, model_sharded_state_dict, is_loading: bool) -> Dict[str, Any]:
    """The ``MuonChainedOptimizer``'s whole sharded state (``sharded_state_dict``)."""
    param_state: Dict[str, object] = {}
    for opt in chain.muon_optimizers:
        param_state.update(_sharded_param_state(opt, model_sharded_state_dict, is_loading))
    return dict(chain_common_state(chain), param_state=param_state)


@torch.no_grad()
def load_optimizer_state(chain, state_dict: Dict[str, Any]) -> None:
    """Load what ``dist_checkpointing.load`` returned for :func:`optimizer_sharded_state`
    into the chained optimizers (collective over each orthogonalization group when there
    are owner-kept states: the holders send their pieces to the new owners)."""
    require_ours(state_dict, "The optimizer state loaded")
    chain.num_steps = int(state_dict["step"])
    commons = state_dict["optimizers"]
    for opt in chain.muon_optimizers:
        load_param_state(opt, own_ranges(opt, state_dict["param_state"]), chain.num_steps)
        opt.load_common_state(commons.get(opt.name) or commons["dense"])


# ---------------------------------------------------------------------------------------
# The format
# ---------------------------------------------------------------------------------------


class TorchDist(CheckpointFormat):
    name = "torch_dist"
    engine = "without --use-megatron-fsdp"
    described = "a torch_dist (DistributedOptimizer)"
    convert_command = "to-torch-dist"
    converted_suffix = "torch_dist"

    def sharded_state_dict(self, chain, model_sharded_state_dict, is_loading: bool, metadata) -> Dict[str, Any]:
        return optimizer_sharded_state(chain, model_sharded_state_dict, is_loading)

    def load_state_dict(self, chain, state_dict: Dict[str, Any]) -> None:
        load_optimizer_state(chain, state_dict)

    def detect(self, path: str) -> bool:
        return stored_format(path) == self.name

    def read_common(self, path: str) -> Dict[str, Any]:
        from megatron.core import dist_checkpointing

        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a checkpoint directory")
        try:
            with bounded(f"the common state of {path}"), restricted_reading():
                return dist_checkpointing.load_common_state_dict(path)
        except (ReadStopped, *READ_ERRORS) as e:  # any unreadable file is the same user error
            raise checkpoint_error_in(e) or CheckpointError(
                f"{path} is not a readable torch_dist checkpoint: {e}"
            ) from e

    def state_of_key(self, key: str) -> str:
        return key[len(STATE_PREFIX) :].split(".", 1)[0]  # optimizer.state.<state>.<param key>

    def adam_needs_resave(self, optimizer_common: Any) -> bool:
        return not all(
            part["param_state_sharding_type"] == "fully_reshardable" for part in megatron_parts(optimizer_common)
        )

    def read(self, path: str, support: ConverterSupport, adam: bool = False) -> Checkpoint:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        with support.collective_io():
            metadata = read_dcp_metadata(path)
            request: Dict[str, Any] = {}
            for key, md in metadata.state_dict_metadata.items():
                if isinstance(md, TensorStorageMetadata):
                    request[key] = ShardedTensor.from_rank_offsets(
                        key, torch.empty(md.size, dtype=md.properties.dtype), replica_id=0
                    )
                elif key.startswith("common_state"):
                    continue
                else:
                    m = _SHARD.match(key)
                    if m is None:
                        continue
                    offset = tuple(int(x) for x in m["offset"].split("."))
                    shape = tuple(int(x) for x in m["shape"].split("."))
                    request[key] = ShardedObject(m["key"], None, shape, offset, replica_id=0)
            try:
                with restricted_reading():
                    loaded = dist_checkpointing.load(request, path)
            except (ReadStopped, *READ_ERRORS) as e:
                raise checkpoint_error_in(e) or CheckpointError(
                    f"{path} could not be read (truncated or corrupt?): {e}"
                ) from e
            ckpt = Checkpoint(common=self.read_common(path))
            for key, req in request.items():
                if isinstance(req, ShardedTensor):
                    ckpt.tensors[key] = loaded[key]
                else:
                    ckpt.objects[(req.key, req.global_offset, req.global_shape)] = loaded[key]
            return ckpt

    def write(self, path: str, ckpt: Checkpoint, support: ConverterSupport) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        with support.collective_io():
            state: Dict[str, Any] = dict(ckpt.common)
            state["__tensors__"] = {
                key: ShardedTensor.from_rank_offsets(key, t.contiguous(), replica_id=0)
                for key, t in ckpt.tensors.items()
            }
            state["__objects__"] = {
                f"{key}/{offset}": ShardedObject(key, value, shape, offset, replica_id=0)
                for (key, offset, shape), value in ckpt.objects.items()
            }
            dist_checkpointing.save(state, path)


TORCH_DIST = TorchDist()
