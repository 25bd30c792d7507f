"""What a checkpoint format's converter read and write need of Megatron-LM
(``checkpoint.format.ConverterSupport``): Megatron-core's collective checkpoint I/O from one
process, and where each model tensor lies in torch_dist's form, read off the model
Megatron-LM builds of a checkpoint's saved arguments.

fsdp_dtensor and torch_dist hold every tensor in model coordinates at its full (TP-global)
shape, but name and lay them out differently (``checkpoint.fsdp_dtensor``). That
correspondence is not written out anywhere: :func:`model_layout` builds the run's model
(from the checkpoint's own arguments, on the meta device, one rank) and reads it off the
model's ``sharded_state_dict``, piece by piece.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch

from megatron_muon.checkpoint.errors import CheckpointError
from megatron_muon.checkpoint.format import ConverterSupport
from megatron_muon.checkpoint.fsdp_dtensor import Layout, Piece
from megatron_muon.checkpoint.optimizer_state import model_param_metadata

from .fsdp_state_dict import glu_parameters


@contextlib.contextmanager
def collective_io() -> Iterator[None]:
    """Megatron's checkpoint I/O, which is collective, from one process: a one-rank gloo group
    (made once, its store in this process: no port, no ``MASTER_*`` variables set for the
    caller) and, on a machine without a GPU, Megatron-core's CPU stand-ins in force inside the
    block only (what a process installed before stays; reading a directory installs nothing
    for the rest of the process)."""
    import torch.distributed as dist

    from .cpu import cpu_patches

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with contextlib.nullcontext() if torch.cuda.is_available() else cpu_patches():
        yield


def _built(sharded) -> list:
    """The ShardedTensors a ShardedTensor or ShardedTensorFactory (GLU: gate, up) stands for."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(sharded.build())) if hasattr(sharded, "build_fn") else [sharded]


def _piece(t) -> Piece:
    return (t.key, tuple(t.global_offset), tuple(t.local_shape))


def model_layout(saved_args) -> Layout:
    """The layout of the model ``saved_args`` (Megatron-LM's arguments of the run) describes,
    built on the meta device at TP1/PP1/EP1 as ``tools/pretrain_gpt.py`` builds it."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from .layer_spec import gpt_model_config

    if saved_args is None:
        raise CheckpointError("the checkpoint holds no Megatron-LM arguments: its model cannot be rebuilt")
    with collective_io():
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        args = copy.copy(saved_args)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "context_parallel_size"):  # fmt: skip
            setattr(args, name, 1)
        args.sequence_parallel, args.use_cpu_initialization = False, True
        config = gpt_model_config(args)
        config.transformer.perform_initialization = False
        with torch.device("meta"):
            model = GPTModelBuilder(config).build_model(
                ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True
            )
        names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        params = {id(p) for p in model.parameters()}
        layout = Layout(glu=set(glu_parameters(model)))
        sharded = model.sharded_state_dict()
        for value in nested_values(sharded):
            if isinstance(value, ShardedObject):
                layout.objects[(value.key, tuple(value.global_offset), tuple(value.global_shape))] = value.data
            elif id(getattr(value, "data", None)) in names:
                for t in _built(value):
                    layout.model.setdefault(names[id(value.data)], []).append(_piece(t))
                    layout.shapes[t.key] = (tuple(t.global_shape), t.dtype)
        for pid, sh in model_param_metadata(sharded).items():
            if pid in params:
                layout.state[names[pid]] = [_piece(t) for t in _built(sh)]
        return layout


SUPPORT = ConverterSupport(collective_io=collective_io, model_layout=model_layout)
"""What every format's ``read`` and ``write`` are given by the converter."""
