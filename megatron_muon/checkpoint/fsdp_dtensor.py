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

SwiGLU: a TP-sharded ``linear_fc1`` holds ``[gate_r; up_r]`` rows on TP rank ``r``, so its
global ``DTensor`` interleaves gate and up by TP rank. Before saving or loading, the
``_w`` (gate) and ``_v`` (up) halves become two ``DTensor`` views, for the weight and for
every optimizer state (:func:`preprocess_state_dict`, which replaces Megatron-LM's
``preprocess_fsdp_dtensor_state_dict``: that one splits only AdamW's two states, and fails
on a model without a ``Float16Module``, i.e. in fp32). Keys and halves are Megatron-LM's,
so its AdamW checkpoints and ours differ only in the state names.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

from ..state import ADAM_STATES, init_adam_states
from .errors import CheckpointError
from .optimizer_state import (
    chain_common_state,
    load_param_state,
    params_in_order,
    require_ours,
    shard_values,
    state_names,
)

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
    return strip_wrappers(opt._param_name(param))


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
                groups[name] = _settings(opt.muon_group_of[id(param)])
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
        load_param_state(opt, local, chain.num_steps, local=True)
        init_adam_states(opt.optimizer)
        for name, param, _ in _adam_params(opt):
            torch_state = opt.optimizer.state[param]
            for key, value in saved.get(name, {}).items():
                if key in ADAM_STATES:
                    torch_state[key].to_local().copy_(value.to_local())
            torch_state["step"] = torch.tensor(float(chain.num_steps))
        opt.load_common_state(common["optimizers"].get(opt.name) or common["optimizers"]["dense"])


# ---------------------------------------------------------------------------------------
# Megatron-LM's state dict, before DCP reads or writes it
# ---------------------------------------------------------------------------------------


def strip_wrappers(name: str) -> str:
    parts = name.split(".")
    while parts and parts[0] in ("module", "model"):
        parts = parts[1:]
    return ".".join(parts)


def glu_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Unwrapped parameter name -> DTensor parameter, for the weights and biases of every
    ``linear_fc1`` whose layer is gated (``config.gated_linear_unit``)."""
    gated = {
        strip_wrappers(name)
        for name, module in model.named_modules()
        if name.endswith("linear_fc1") and getattr(getattr(module, "config", None), "gated_linear_unit", False)
    }
    return {
        strip_wrappers(name): param
        for name, param in model.named_parameters()
        if strip_wrappers(name).rsplit(".", 1)[0] in gated
    }


def split_glu(data, param, is_expert: bool) -> Tuple[Any, Any]:
    """The gate and up halves of a (TP-local) GLU ``linear_fc1`` tensor ``data``, a
    ``DTensor`` sharded like ``param``: two ``DTensor`` views of its local shard (collective
    over the FSDP and TP meshes, to agree on the uneven shard offsets)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor
    from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes

    index = param.megatron_fsdp_dist_index
    mine = param.megatron_fsdp_slice  # this rank's flat range of the TP-local tensor
    tp = index.get_submesh([index.tp_dim], is_expert_parallel=is_expert).mesh.numel()
    shape = list(data.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] //= tp
    if shape[0] % 2:
        raise CheckpointError(f"a GLU linear_fc1 of TP-local shape {tuple(shape)} has an odd number of rows")
    half = data.numel() // tp // 2
    local = data.to_local().reshape(-1)
    out = []
    for meta, (start, stop) in zip(torch.empty(shape, device="meta").chunk(2, dim=0), ((0, half), (half, 2 * half))):
        lo, hi = max(start, mine.start), min(stop, mine.stop)
        piece = local[lo - mine.start : hi - mine.start] if lo < hi else local[:0]
        copy_tensor_model_parallel_attributes(meta, param)
        out.append(
            make_fsdp_dtensor(
                piece.view(-1, *shape[1:]), meta, dist_index=index, is_expert_param=is_expert, run_check=True,
                update_uneven_dtensor_chunk_meta=True,
            )
        )  # fmt: skip
    return out[0], out[1]


def _split_entries(entries: Dict[str, Any], glu: Dict[str, torch.nn.Parameter], local_name) -> Dict[str, Any]:
    """``entries`` (model tensors, or per-parameter optimizer state dicts) with each GLU
    ``linear_fc1`` replaced by its ``_w`` and ``_v`` halves (every ``DTensor`` in it split)."""
    out = {}
    for key, value in entries.items():
        param = glu.get(strip_wrappers(local_name(key)))
        if param is None:
            out[key] = value
            continue
        is_expert = "mlp.experts" in key
        if isinstance(value, dict):
            halves = ({}, {})
            for sub, tensor in value.items():
                parts = split_glu(tensor, param, is_expert) if hasattr(tensor, "to_local") else (tensor, tensor)
                halves[0][sub], halves[1][sub] = parts
        else:
            halves = split_glu(value, param, is_expert)
        for suffix, half in zip(GLU_HALVES, halves):
            out[key + suffix] = half
    return out


def _with_empty_shard_states(optimizer: Dict[str, Any], model: torch.nn.Module, num_experts) -> Dict[str, Any]:
    """Megatron's AdamW on Megatron-FSDP keeps no state for a parameter whose shard on this
    rank is empty, but saving and loading are one collective per ``DTensor`` key: zero
    ``exp_avg`` / ``exp_avg_sq`` (of no elements) for those, in a copy (the dict Megatron-LM
    loads into the optimizer stays without them)."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import expert_param_local_key

    missing = [name for name in optimizer["param_to_group_meta"] if name not in optimizer["state"]]
    if not missing:
        return optimizer
    params = {strip_wrappers(name): param for name, param in model.named_parameters()}
    state = dict(optimizer["state"])
    for name in missing:
        param = params[strip_wrappers(expert_param_local_key(strip_wrappers(name), num_experts))]
        state[name] = {key: torch.zeros_like(param) for key in ADAM_STATES}
    return dict(optimizer, state=state)


def preprocess_state_dict(args, raw_state_dict: Dict[str, Any], model: torch.nn.Module) -> Dict[str, Any]:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict``, for every optimizer state and
    every precision: FP8 extra state dropped, GLU halves split (model and optimizer), local
    expert keys renumbered globally, uneven shard offsets attached. Returns new dicts; the
    ``DTensor`` views it makes share storage with the input's, so a load into them fills it."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        expert_param_local_key,
        handle_experts_in_state_dict,
        handle_fp8_extra_state_case,
    )

    state_dict = dict(raw_state_dict)
    state_dict["model"] = dict(state_dict["model"])
    handle_fp8_extra_state_case(state_dict["model"])
    num_experts = getattr(args, "num_experts", None)
    optimizer = state_dict.get("optimizer")
    if isinstance(optimizer, dict) and "param_to_group_meta" in optimizer:
        state_dict["optimizer"] = _with_empty_shard_states(optimizer, model, num_experts)
    glu = glu_parameters(model) if getattr(args, "swiglu", False) else {}
    if glu:
        state_dict["model"] = _split_entries(state_dict["model"], glu, lambda key: key)
        optimizer = state_dict.get("optimizer")
        if isinstance(optimizer, dict) and optimizer.get("state"):
            optimizer = state_dict["optimizer"] = dict(optimizer)
            optimizer["state"] = _split_entries(
                optimizer["state"], glu, lambda key: expert_param_local_key(strip_wrappers(key), num_experts)
            )
    if num_experts:
        state_dict["model"] = handle_experts_in_state_dict(state_dict["model"], num_experts)
    preprocess_state_dict_for_uneven_dtensor(state_dict)
    return state_dict
