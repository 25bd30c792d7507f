"""Muon optimizer state in Megatron-FSDP's ``fsdp_dtensor`` checkpoints.

Megatron-LM saves a Megatron-FSDP run with ``torch.distributed.checkpoint`` (DCP): the
model's ``DTensor`` parameters (the fp32 main weights) and the optimizer's
``{"state": {param name: {state: DTensor}}, "param_to_group_meta": ...}``. Every state is a
``DTensor`` sharded exactly like its parameter (this rank's flat FSDP shard, TP-global
shape), so DCP reshards it between DP and TP sizes as it reshards the weights. Ours is the
same dict, with the same parameter names (experts numbered globally): AdamW's ``exp_avg``
and ``exp_avg_sq`` for the non-matrix parameters, the Muon registry's states
(``state.muon_states``: ``momentum_buffer``...) for the matrices. A Muon state is wrapped
from this rank's flat shard of it, on every rank, empty shards included: saving is one
collective per ``DTensor``, so every rank must hold every key. States kept per logical
matrix on its owner are first scattered to the shards (``optimizer_state.shard_values``). The
common part (format, steps, grad scaler, settings: ``optimizer_state.common_state``) is one
object under ``"muon"``.

The converter reads such a checkpoint (or Megatron AdamW's) into its torch_dist form and
writes one from it. The two formats hold the same tensors under different names and
layouts: fsdp_dtensor keeps one tensor per parameter under the model's unwrapped name
(GLU ``linear_fc1`` as ``_w`` / ``_v`` halves, the fp32 masters as the model's weights);
torch_dist keeps what the model's ``sharded_state_dict`` names, a fused expert or GLU
weight in pieces. Which piece of which torch_dist tensor a parameter is, is read from the
model Megatron-LM builds of the saved arguments (a :class:`Layout`, which the glue gives:
``ConverterSupport.model_layout``); every torch_dist tensor must be tiled exactly by the
pieces, every fsdp_dtensor tensor used: otherwise the conversion stops.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

import torch

from ..state import ADAM_STATES, MASTER, init_adam_states
from .errors import CheckpointError, ReadStopped, checkpoint_error_in
from .format import Checkpoint, CheckpointFormat, ConverterSupport
from .integrity import stored_format
from .optimizer_state import (
    READ_ERRORS,
    STATE_PREFIX,
    chain_common_state,
    load_param_state,
    megatron_parts,
    optimizer_kind,
    params_in_order,
    require_ours,
    shard_values,
    state_names,
)
from .optimizer_state import state_key as torch_dist_key
from .reading import bounded, read_dcp_metadata, restricted_reading

COMMON = "optimizer.muon.common"
"""The stored key of our optimizer's common state (a :class:`CommonState`)."""
GROUP_META = "optimizer.param_to_group_meta."
"""The stored keys' prefix of Megatron's ``param_to_group_meta`` (a parameter's group settings)."""
GLU_HALVES = ("_w", "_v")
"""Suffixes of the gate and up halves of a GLU ``linear_fc1`` (Megatron-LM's)."""


class CommonState:
    """The checkpoint's non-tensor optimizer state as one DCP object (not traversed)."""

    def __init__(self, value: Dict[str, Any]) -> None:
        self.value = value


# ---------------------------------------------------------------------------------------
# Optimizer state <-> DTensors
# ---------------------------------------------------------------------------------------


def _like(flat: torch.Tensor, param) -> Any:
    """``flat`` (this rank's shard, 1-D) as a ``DTensor`` with ``param``'s sharding."""
    from torch.distributed.tensor import DTensor

    local = param.to_local()
    return DTensor.from_local(
        flat.view(local.shape), param.device_mesh, param.placements, run_check=False, shape=param.shape,
        stride=param.stride(),
    )  # fmt: skip


def param_name(opt, param) -> str:
    """A parameter's name in our fsdp_dtensor optimizer state: Megatron's (experts numbered
    globally) without the wrappers' ``module.`` prefixes, whose number changes with the
    precision (``Float16Module``): the model's own key, the same in fp32 and bf16 runs."""
    return strip_wrappers(opt.storage.param_name(param))


def _muon_params(opt) -> Iterator[Tuple[str, Any]]:
    """(checkpoint name, DTensor parameter) of every Muon matrix parameter of ``opt``."""
    for mp in opt.muon_params:
        yield param_name(opt, mp.param), mp.param


def _adam_params(opt) -> Iterator[Tuple[str, Any, dict]]:
    """(checkpoint name, DTensor parameter, its group) of every AdamW parameter of ``opt``."""
    for group in opt.optimizer.param_groups:
        if not group.get("muon", False):
            for param in group["params"]:
                yield param_name(opt, param), param, group


def _settings(group: dict) -> Dict[str, Any]:
    """A parameter group's settings, as Megatron's ``param_to_group_meta`` records them."""
    return {k: v for k, v in group.items() if k != "params"}


@torch.no_grad()
def optimizer_state(chain, is_loading: bool) -> Dict[str, Any]:
    """The ``MuonChainedOptimizer``'s ``fsdp_dtensor`` state (module docstring). For loading,
    zeros of the same structure that DCP fills in place."""
    state: Dict[str, Dict[str, Any]] = {}
    groups: Dict[str, Dict[str, Any]] = {}
    for opt in chain.muon_optimizers:
        init_adam_states(opt.optimizer)  # AdamW states on every rank, empty shards included
        values = {} if is_loading else shard_values(opt)  # collective with owner-kept states
        for name, param in _muon_params(opt):
            if not is_loading:  # Megatron's group settings, for a conversion to its AdamW (muon-to-adam)
                groups[name] = _settings(opt.storage.muon_group_of[id(param)])
            mine = values.get(id(param), {})
            entry = state[name] = {}
            for key in state_names(opt, param)[1:]:  # the master is the model's weight
                flat = mine.get(key)
                flat = torch.zeros(param.to_local().numel()) if flat is None else flat.float()
                entry[key] = _like(flat.to(param.device), param)
        for name, param, group in _adam_params(opt):
            state[name] = {key: opt.optimizer.state[param][key] for key in ADAM_STATES}
            if not is_loading:  # Megatron's format has it; on loading, the schedule sets ours
                groups[name] = _settings(group)
    # Loading: a placeholder that only the checkpoint's own object replaces (DCP leaves a key
    # the checkpoint lacks as it is), so a checkpoint without it is refused, not read as ours.
    common = CommonState({} if is_loading else chain_common_state(chain))
    return {"state": state, "param_to_group_meta": groups, "muon": {"common": common}}


@torch.no_grad()
def load_optimizer_state(chain, state_dict: Dict[str, Any]) -> None:
    """Load what DCP filled into :func:`optimizer_state`'s dict (collective over each
    orthogonalization group with owner-kept states)."""
    common = state_dict.get("muon", {}).get("common")
    common = common.value if isinstance(common, CommonState) else None
    require_ours(common, "The fsdp_dtensor checkpoint loaded")
    chain.num_steps = int(common["step"])
    saved = state_dict["state"]
    for opt in chain.muon_optimizers:
        local = {
            key: {state: value.to_local() for state, value in saved.get(param_name(opt, param), {}).items()}
            for key, param in params_in_order(opt)
        }
        load_param_state(opt, local, chain.num_steps)
        init_adam_states(opt.optimizer)
        for name, param, _ in _adam_params(opt):
            torch_state = opt.optimizer.state[param]
            for key, value in saved.get(name, {}).items():
                if key in ADAM_STATES:
                    torch_state[key].to_local().copy_(value.to_local())
            torch_state["step"] = torch.tensor(float(chain.num_steps))
        opt.load_common_state(common["optimizers"].get(opt.name) or common["optimizers"]["dense"])


def strip_wrappers(name: str) -> str:
    """A parameter name without the wrappers' ``module.`` / ``model.`` prefixes."""
    parts = name.split(".")
    while parts and parts[0] in ("module", "model"):
        parts = parts[1:]
    return ".".join(parts)


# ---------------------------------------------------------------------------------------
# Reading a directory of it
# ---------------------------------------------------------------------------------------


def load_dcp(path: str, wanted: Callable[[str], bool] = lambda key: True) -> Dict[str, Any]:
    """The tensors (whole) and objects of the DCP checkpoint ``path`` whose keys are
    ``wanted``, by DCP key (verified first by the caller)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for key, md in read_dcp_metadata(path).state_dict_metadata.items()
        if wanted(key)
    }
    try:
        with restricted_reading():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    except (ReadStopped, *READ_ERRORS) as e:
        raise checkpoint_error_in(e) or CheckpointError(
            f"{path} could not be read as an fsdp_dtensor checkpoint: {e}"
        ) from e
    return state


def read_common(path: str) -> Dict[str, Any]:
    """The common state of the fsdp_dtensor checkpoint ``path`` as torch_dist's
    ``read_common`` gives its own: iteration, arguments, checkpoint version (which of the arguments
    Megatron-LM's ``check_checkpoint_args`` compares) and the optimizer's (ours, or Megatron's
    AdamW marked as such), without reading a tensor."""
    scalars = ("iteration", "args", "checkpoint_version")
    with bounded(f"the common state of {path}"):
        state = load_dcp(path, lambda key: key in (*scalars, COMMON) or key.startswith(GROUP_META))
    common = {k: v for k, v in state.items() if k in scalars}
    if isinstance(state.get(COMMON), CommonState):
        common["optimizer"] = state[COMMON].value
    elif any(k.startswith(GROUP_META) for k in state):
        common["optimizer"] = {"param_state_sharding_type": "fsdp_dtensor"}
    return common


# ---------------------------------------------------------------------------------------
# The converter: fsdp_dtensor <-> the torch_dist form
# ---------------------------------------------------------------------------------------

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
    steps = [float(v) for k, v in flat.items() if k.startswith(STATE_PREFIX) and k.endswith(".step")]
    groups = []
    for meta in metas.values():
        if meta not in groups:
            groups.append(meta)
    for group in groups:
        group["step"] = max(steps, default=0.0)
    return {"param_state_sharding_type": "fully_reshardable", "optimizer": {"param_groups": groups}}


def _read(path: str, support: ConverterSupport, adam: bool = False) -> Checkpoint:
    """The fsdp_dtensor checkpoint at ``path`` in the converter's torch_dist form: a Muon
    run's, or with ``adam`` Megatron's AdamW's."""
    flat = load_dcp(path)
    common = flat.get(COMMON)
    if isinstance(common, CommonState) and optimizer_kind(common.value) == "megatron_muon":
        optimizer = common.value
    elif adam and any(k.startswith(GROUP_META) for k in flat):
        optimizer = _adam_common(flat)
    else:
        raise CheckpointError(f"{path} holds no Muon optimizer state of megatron_muon; only a Muon run is converted")
    args = flat.get("args")
    layout = support.model_layout(args)
    model = _join_halves({k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")})
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith(STATE_PREFIX) and isinstance(value, torch.Tensor) and value.dim() > 0:
            name, state = key[len(STATE_PREFIX) :].rsplit(".", 1)
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


def _halves(name: str, tensor: torch.Tensor, glu: Set[str]) -> Dict[str, torch.Tensor]:
    if name not in glu:
        return {name: tensor}
    return {name + suffix: half.contiguous() for suffix, half in zip(GLU_HALVES, tensor.chunk(2))}


def _write(path: str, ckpt: Checkpoint, support: ConverterSupport) -> None:
    """Write the torch_dist form ``ckpt`` of a Muon run (or, after muon-to-adam, of Megatron's
    AdamW) as an fsdp_dtensor checkpoint into the empty directory ``path``."""
    import torch.distributed.checkpoint as dcp

    optimizer = ckpt.common.get("optimizer", {})
    adam = optimizer_kind(optimizer) == "megatron"  # Megatron's AdamW (muon-to-adam)
    if optimizer_kind(optimizer) != "megatron_muon" and not adam:
        raise CheckpointError("only a Muon checkpoint of megatron_muon moves to Megatron-FSDP (adam-to-muon first)")
    args = ckpt.common.get("args")
    layout = support.model_layout(args)
    by_state: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in ckpt.tensors.items():
        if key.startswith(STATE_PREFIX):
            state, name = key[len(STATE_PREFIX) :].split(".", 1)
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


# ---------------------------------------------------------------------------------------
# The format
# ---------------------------------------------------------------------------------------


class FsdpDtensor(CheckpointFormat):
    name = "fsdp_dtensor"
    engine = "with --use-megatron-fsdp"
    described = "an fsdp_dtensor (Megatron-FSDP)"
    convert_command = "to-fsdp-dtensor"
    converted_suffix = "fsdp"
    megatron_dcp_only = True
    async_save = False  # Megatron-core's async writer bypasses the staging directory and manifest

    def sharded_state_dict(self, chain, model_sharded_state_dict, is_loading: bool, metadata) -> Dict[str, Any]:
        sharding = (metadata or {}).get("distrib_optim_sharding_type")
        if sharding != self.name:
            raise NotImplementedError(
                "megatron_muon saves its state on Megatron-FSDP only as an fsdp_dtensor checkpoint "
                f"(metadata distrib_optim_sharding_type='fsdp_dtensor', got {sharding!r}; Megatron-LM: "
                "--ckpt-format fsdp_dtensor)."
            )
        return optimizer_state(chain, is_loading)

    def load_state_dict(self, chain, state_dict: Dict[str, Any]) -> None:
        load_optimizer_state(chain, state_dict)

    def detect(self, path: str) -> bool:
        """DCP's ``.metadata``; one that lost it is still one, by its ``.distcp`` files (never
        read as another format)."""
        if stored_format(path) == self.name:
            return True
        return (
            stored_format(path) == "unknown"
            and os.path.isdir(path)
            and any(n.endswith(".distcp") for n in os.listdir(path))
        )

    def read_common(self, path: str) -> Dict[str, Any]:
        return read_common(path)

    def state_of_key(self, key: str) -> str:
        return key.rsplit(".", 1)[1]  # optimizer.state.<param name>.<state>

    def read(self, path: str, support: ConverterSupport, adam: bool = False) -> Checkpoint:
        return _read(path, support, adam)

    def write(self, path: str, ckpt: Checkpoint, support: ConverterSupport) -> None:
        _write(path, ckpt, support)


FSDP_DTENSOR = FsdpDtensor()
