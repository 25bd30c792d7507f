"""Megatron-LM's ``fsdp_dtensor`` state dict, before DCP reads or writes it.

SwiGLU: a TP-sharded ``linear_fc1`` holds ``[gate_r; up_r]`` rows on TP rank ``r``, so its
global ``DTensor`` interleaves gate and up by TP rank. Before saving or loading, the
``_w`` (gate) and ``_v`` (up) halves become two ``DTensor`` views, for the weight and for
every optimizer state (:func:`preprocess_state_dict`, which replaces Megatron-LM's
``preprocess_fsdp_dtensor_state_dict``: that one splits only AdamW's two states, and fails
on a model without a ``Float16Module``, i.e. in fp32). Keys and halves are Megatron-LM's,
so its AdamW checkpoints and ours differ only in the state names.

The optimizer's own part of the state dict is ``megatron_muon.checkpoint.fsdp_dtensor``'s.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from megatron_muon.checkpoint.errors import CheckpointError
from megatron_muon.checkpoint.fsdp_dtensor import GLU_HALVES, strip_wrappers
from megatron_muon.state import ADAM_STATES


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
