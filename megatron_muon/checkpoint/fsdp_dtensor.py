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
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

from ..state import ADAM_STATES, init_adam_states
from .optimizer_state import (
    chain_common_state,
    load_param_state,
    params_in_order,
    require_ours,
    shard_values,
    state_names,
)


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
