"""The ``torch_dist`` checkpoint format: Megatron-core's dist-checkpointing (a
``metadata.json`` beside torch DCP's files), which the DistributedOptimizer's runs write.

The optimizer's part is :mod:`.optimizer_state`'s (every state in model coordinates, each
rank writing and reading its own ranges). The converter reads a whole checkpoint with
every tensor at its full global shape in one process (one request per stored key, replica
0) and writes one the same way: Megatron-core then reshards it to whatever layout loads it.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict

import torch

from .errors import CheckpointError, ReadStopped, checkpoint_error_in
from .format import Checkpoint, CheckpointFormat, ConverterSupport
from .integrity import stored_format
from .optimizer_state import READ_ERRORS, STATE_PREFIX, load_optimizer_state, megatron_parts, optimizer_sharded_state
from .reading import bounded, read_dcp_metadata, restricted_reading

_SHARD = re.compile(r"^(?P<key>.+)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")
"""A sharded object's stored key: its key, global offset and global shape."""


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
