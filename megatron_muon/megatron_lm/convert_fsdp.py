"""A Muon run moved between Megatron-FSDP (``fsdp_dtensor``) and the DistributedOptimizer
(``torch_dist``): ``tools/convert_checkpoint.py to-torch-dist`` / ``to-fsdp-dtensor``.

Both formats hold every tensor in model coordinates at its full (TP-global) shape, but name
and lay them out differently. fsdp_dtensor keeps one tensor per parameter under the
model's own name (``model.module.<name>``, optimizer ``optimizer.state.<name>.<state>``,
GLU ``linear_fc1`` as ``_w`` / ``_v`` halves, experts numbered globally; the fp32 main
weights are the model's weights). torch_dist keeps what the model's ``sharded_state_dict``
says: layers and experts stacked into leading dims, norms under the names of the layers
they fuse into, GLU halves at offsets of one ``[gate; up]`` tensor, the model in its own
dtype and the fp32 masters as ``optimizer.state.param``.

That correspondence is not written out here: :func:`model_layout` builds the run's model
(from the checkpoint's own arguments, on the meta device, one rank) and reads it off the
model's ``sharded_state_dict``, piece by piece. Every torch_dist tensor must be tiled
exactly by the pieces, every fsdp_dtensor tensor used: otherwise the conversion stops.
RNG states move between the two forms of Megatron-LM's per-(PP, TP) rank record.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

import torch

from megatron_muon.checkpoint.errors import CheckpointError
from megatron_muon.checkpoint.fsdp_dtensor import CommonState, strip_wrappers
from megatron_muon.checkpoint.optimizer_state import STATE_PREFIX as OPTIMIZER_STATE
from megatron_muon.checkpoint.optimizer_state import megatron_parts, model_param_metadata, optimizer_kind
from megatron_muon.checkpoint.optimizer_state import state_key as torch_dist_key
from megatron_muon.megatron_lm.fsdp_state_dict import GLU_HALVES, glu_parameters
from megatron_muon.state import MASTER

from .checkpoint_dirs import COMMON, GROUP_META, Checkpoint, collective_io, load_dcp

CONTENT_METADATA = {  # how Megatron-LM labels a torch_dist save of ours (fully reshardable)
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": False,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
Piece = Tuple[str, Tuple[int, ...], Tuple[int, ...]]
"""(torch_dist key, global offset, shape of the piece)."""


@dataclass
class Layout:
    """Where each model tensor (by its unwrapped name) lies in a torch_dist checkpoint."""

    model: Dict[str, List[Piece]] = field(default_factory=dict)
    """Every piece of every parameter and buffer (a tied weight lies under two keys)."""
    state: Dict[str, List[Piece]] = field(default_factory=dict)
    """The pieces its optimizer states and fp32 master lie in (parameters only)."""
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    """torch_dist model key -> (global shape, dtype)."""
    objects: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], Any] = field(default_factory=dict)
    glu: Set[str] = field(default_factory=set)
    """Names kept as ``_w`` / ``_v`` halves in fsdp_dtensor checkpoints."""


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


def _index(offset: Tuple[int, ...], shape: Tuple[int, ...]) -> Tuple[slice, ...]:
    """A piece's slice of its global tensor (one element of each prepended layer / expert dim)."""
    sizes = (1,) * (len(offset) - len(shape)) + tuple(shape)
    return tuple(slice(o, o + n) for o, n in zip(offset, sizes))


def _place(pieces: List[Piece], whole: torch.Tensor, out: Dict[str, torch.Tensor], filled: Dict[str, int]) -> None:
    """Write ``whole`` (a model tensor) into the torch_dist tensors ``out`` at its pieces
    (split along dim 0: a GLU weight's gate and up rows)."""
    rows = [shape[0] for _, _, shape in pieces]
    if sum(rows) != whole.shape[0]:
        raise CheckpointError(f"a tensor of shape {tuple(whole.shape)} does not fit pieces {pieces}")
    for (key, offset, shape), part in zip(pieces, whole.split(rows)):
        index = _index(offset, shape)
        out[key][index] = part.reshape(out[key][index].shape)
        filled[key] = filled.get(key, 0) + part.numel()


def _take(pieces: List[Piece], tensors: Dict[str, torch.Tensor]) -> torch.Tensor:
    """A model tensor from its pieces of the torch_dist tensors (joined along dim 0)."""
    parts = [tensors[key][_index(offset, shape)].reshape(shape) for key, offset, shape in pieces]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _check_tiled(filled: Dict[str, int], tensors: Dict[str, torch.Tensor]) -> None:
    for key, tensor in tensors.items():
        if filled.get(key, 0) != tensor.numel():
            raise CheckpointError(
                f"{key}: {filled.get(key, 0)} of its {tensor.numel()} elements found in the source; the model its "
                "arguments describe does not match the checkpoint's tensors (another layer spec or backend?)"
            )


def _retarget(args, use_megatron_fsdp: bool):
    args = copy.copy(args)
    args.use_megatron_fsdp = use_megatron_fsdp
    args.ckpt_format = "fsdp_dtensor" if use_megatron_fsdp else "torch_dist"
    return args


def _nest(flat: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    """``{prefix + "a.b": v}`` -> ``{"a": {"b": v}}`` (DCP's flattening undone)."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(prefix):
            *path, last = key[len(prefix) :].split(".")
            node = out
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    return out


def _rng_objects(rng: Dict[str, Any], args) -> Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], Any]:
    """fsdp_dtensor's ``rng_state`` (``{"(pp, tp)": [state, ...]}``, the list flattened by
    DCP into ``"0"``, ``"1"``... keys) as torch_dist's ``rng_state`` sharded objects."""
    grid = (args.pipeline_model_parallel_size, args.tensor_model_parallel_size)
    out = {}
    for where, states in rng.items():
        offset = tuple(int(x) for x in where.strip("()").split(","))
        out[("rng_state", offset, grid)] = [states[str(i)] for i in range(len(states))]
    return out


# ---------------------------------------------------------------------------------------
# fsdp_dtensor -> the converter's torch_dist form
# ---------------------------------------------------------------------------------------


def _join_halves(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Unwrapped names -> tensors, GLU ``_w`` / ``_v`` halves joined into one ``[gate; up]``."""
    out, halves = {}, {}
    for key, tensor in tensors.items():
        name = strip_wrappers(key)
        suffix = name[-2:]
        if suffix in GLU_HALVES and ".linear_fc1." in name:
            halves.setdefault(name[:-2], {})[suffix] = tensor
        else:
            out[name] = tensor
    for name, pair in halves.items():
        out[name] = torch.cat([pair[s] for s in GLU_HALVES])
    return out


def _group_metas(flat: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Unwrapped parameter name -> its optimizer group's settings (``param_to_group_meta``)."""
    metas: Dict[str, Dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(GROUP_META):
            name, setting = key[len(GROUP_META) :].rsplit(".", 1)
            metas.setdefault(strip_wrappers(name), {})[setting] = value
    return metas


def _adam_common(flat: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's AdamW common state (``fully_reshardable``, as ``convert.adam_to_muon``
    reads it) from an fsdp_dtensor checkpoint of its: the parameter groups (each
    parameter's ``param_to_group_meta``, distinct), with the largest per-parameter step."""
    metas = _group_metas(flat)
    steps = [float(v) for k, v in flat.items() if k.startswith(OPTIMIZER_STATE) and k.endswith(".step")]
    groups = []
    for meta in metas.values():
        if meta not in groups:
            groups.append(meta)
    for group in groups:
        group["step"] = max(steps, default=0.0)
    return {"param_state_sharding_type": "fully_reshardable", "optimizer": {"param_groups": groups}}


def read_fsdp_dtensor(path: str, adam: bool = False) -> Checkpoint:
    """The fsdp_dtensor checkpoint at ``path`` in the converter's torch_dist form (verify it
    first: ``convert.check_source``): a Muon run's, or with ``adam`` Megatron's AdamW's."""
    flat = load_dcp(path)
    common = flat.get(COMMON)
    if isinstance(common, CommonState) and optimizer_kind(common.value) == "megatron_muon":
        optimizer = common.value
    elif adam and any(k.startswith(GROUP_META) for k in flat):
        optimizer = _adam_common(flat)
    else:
        raise CheckpointError(f"{path} holds no Muon optimizer state of megatron_muon; only a Muon run is converted")
    args = flat.get("args")
    layout = model_layout(args)
    model = _join_halves({k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")})
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith(OPTIMIZER_STATE) and isinstance(value, torch.Tensor) and value.dim() > 0:
            name, state = key[len(OPTIMIZER_STATE) :].rsplit(".", 1)
            states.setdefault(state, {})[name] = value
    ckpt = Checkpoint(objects=dict(layout.objects), group_meta=_group_metas(flat))
    filled: Dict[str, int] = {}
    for key, (shape, dtype) in layout.shapes.items():
        ckpt.tensors[key] = torch.zeros(shape, dtype=dtype)
    unused = set(model) - set(layout.model)
    if unused:
        raise CheckpointError(f"{path} holds {sorted(unused)[:3]}..., which the model its arguments describe lacks")
    for name, pieces in layout.model.items():
        if name not in model:
            raise CheckpointError(f"{path} lacks the model tensor {name}")
        _place(pieces, model[name], ckpt.tensors, filled)
    _check_tiled(filled, ckpt.tensors)
    for state, by_name in [(MASTER, model), *((s, _join_halves(t)) for s, t in states.items())]:
        tensors: Dict[str, torch.Tensor] = {}
        filled = {}
        for name, pieces in layout.state.items():
            if name in by_name:
                for key, _, _ in pieces:
                    tensors.setdefault(key, torch.zeros(layout.shapes[key][0], dtype=torch.float32))
                _place(pieces, by_name[name].float(), tensors, filled)
        _check_tiled(filled, tensors)
        ckpt.tensors.update({torch_dist_key(state, key): t for key, t in tensors.items()})
    ckpt.objects.update(_rng_objects(_nest(flat, "rng_state."), args))
    ckpt.common = {
        "args": _retarget(args, use_megatron_fsdp=False),
        "checkpoint_version": flat.get("checkpoint_version"),
        "iteration": flat.get("iteration"),
        "optimizer": optimizer,
        "opt_param_scheduler": _nest(flat, "opt_param_scheduler."),
        "rerun_state_machine": _nest(flat, "rerun_state_machine.") or None,
        "num_floating_point_operations_so_far": flat.get("num_floating_point_operations_so_far", 0),
        "content_metadata": dict(CONTENT_METADATA),
    }
    return ckpt


# ---------------------------------------------------------------------------------------
# The torch_dist form -> fsdp_dtensor
# ---------------------------------------------------------------------------------------


def _halves(name: str, tensor: torch.Tensor, glu: Set[str]) -> Dict[str, torch.Tensor]:
    if name not in glu:
        return {name: tensor}
    return {name + suffix: half.contiguous() for suffix, half in zip(GLU_HALVES, tensor.chunk(2))}


def write_fsdp_dtensor(path: str, ckpt: Checkpoint) -> None:
    """Write the torch_dist form ``ckpt`` of a Muon run as an fsdp_dtensor checkpoint into
    the empty directory ``path`` (``checkpoint_dirs.write_checkpoint``'s twin)."""
    import torch.distributed.checkpoint as dcp

    optimizer = ckpt.common.get("optimizer", {})
    adam = optimizer_kind(optimizer) == "megatron"  # Megatron's AdamW (muon-to-adam)
    if optimizer_kind(optimizer) != "megatron_muon" and not adam:
        raise CheckpointError("only a Muon checkpoint of megatron_muon moves to Megatron-FSDP (adam-to-muon first)")
    args = ckpt.common.get("args")
    layout = model_layout(args)
    by_state: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in ckpt.tensors.items():
        if key.startswith(OPTIMIZER_STATE):
            state, name = key[len(OPTIMIZER_STATE) :].split(".", 1)
            by_state.setdefault(state, {})[name] = tensor
    masters = by_state.pop(MASTER, {})
    model, states = {}, {}
    for name, pieces in layout.model.items():
        if name in layout.state:  # Megatron-FSDP's model weights are the fp32 main weights
            whole = _take(layout.state[name], masters).float()
        else:  # a buffer (the router's expert bias)
            whole = _take(pieces, ckpt.tensors)
        model.update(_halves(name, whole, layout.glu))
        for state, tensors in by_state.items():
            if name in layout.state and all(key in tensors for key, _, _ in layout.state[name]):
                for half, tensor in _halves(name, _take(layout.state[name], tensors).float(), layout.glu).items():
                    states.setdefault(half, {})[state] = tensor
    state_dict = {
        "model": {f"module.{k}": v for k, v in model.items()},
        "optimizer": _adam_optimizer(ckpt, layout, states, args)
        if adam
        else {"state": states, "param_to_group_meta": {}, "muon": {"common": CommonState(optimizer)}},
        "args": _retarget(ckpt.common.get("args"), use_megatron_fsdp=True),
        "iteration": ckpt.common.get("iteration"),
        "checkpoint_version": ckpt.common.get("checkpoint_version"),
        "num_floating_point_operations_so_far": ckpt.common.get("num_floating_point_operations_so_far", 0),
    }
    for name in ("opt_param_scheduler", "rerun_state_machine"):
        if ckpt.common.get(name):
            state_dict[name] = ckpt.common[name]
    rng = {
        f"({', '.join(map(str, offset))})": value
        for (key, offset, _), value in ckpt.objects.items()
        if key == "rng_state"
    }
    if rng:
        state_dict["rng_state"] = rng
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path))


def _adam_optimizer(ckpt: Checkpoint, layout: Layout, states: Dict[str, Dict[str, torch.Tensor]], args) -> Dict:
    """Megatron AdamW's fsdp_dtensor optimizer state: its own parameter names (the wrappers'
    ``module.`` prefixes, one more with a ``Float16Module``), a step per parameter, and
    every parameter's group settings, from the Muon checkpoint's (``muon`` flag dropped)."""
    prefix = "module.module." + ("module." if getattr(args, "bf16", False) or getattr(args, "fp16", False) else "")
    groups = [g for part in megatron_parts(ckpt.common["optimizer"]) for g in part["optimizer"]["param_groups"]]
    step = torch.tensor(float(max((g.get("step", 0) for g in groups), default=0)))
    metas = {}
    for name in layout.state:
        if name not in ckpt.group_meta:
            raise CheckpointError(
                f"the checkpoint holds no optimizer group settings of {name} (saved by an older megatron_muon); "
                "muon-to-adam it on torch_dist (to-torch-dist first)"
            )
        metas[prefix + name] = {k: v for k, v in ckpt.group_meta[name].items() if k != "muon"}
    state = {prefix + name: dict(s, step=step.clone()) for name, s in states.items()}
    return {"state": state, "param_to_group_meta": metas}
