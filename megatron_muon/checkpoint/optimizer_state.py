"""The Muon optimizer's state in model coordinates, as every checkpoint format keeps it.

Every optimizer state tensor is saved in *model coordinates*: for each model parameter,
its fp32 master weight (``param``) and its states (the registry's, ``state.MUON_STATES``,
for a Muon matrix: ``momentum_buffer``, with variance reduction ``second_moment``; AdamW's
``exp_avg``, ``exp_avg_sq`` for the others), each with the shape of the parameter and
exactly the parameter's own sharding metadata (global key, global offsets, TP/PP/EP
fragmentation, GLU and expert factories). So whatever layouts Megatron can
reshard the model between (TP, PP, EP, expert-TP, DP, the expert storage layouts), it
reshards the optimizer state between too; logical matrices are subsets of parameters and
follow. The key names are Megatron's ``fully_reshardable`` names
(``optimizer.state.<state>.<param key>``), so a Megatron AdamW checkpoint differs from
ours only in which state keys exist (``tools/convert_checkpoint.py`` converts).

Here is what the formats share (``torch_dist``, ``fsdp_dtensor``: each format's own module
lays it out): a rank's values of each state for a save (:func:`shard_values`: owner-kept
states first expanded to the matrix and cut to the holders of its pieces, the step's own
scatter), setting them back after a load (:func:`load_param_state`: owner-kept states
travel back to the, possibly different, owners), the common state (:func:`common_state`),
whether optimizer state is ours at all (:func:`require_ours`) and which states a load reads
(:func:`states_to_load`: a state the registry marks optional and the checkpoint lacks starts
at zero; a required one missing is refused), for every format and tool.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed.checkpoint.api

from .. import state as registry
from ..state import MASTER, checkpoint_states, muon_states, required_in_checkpoint
from .errors import CheckpointError
from .reading import read_dcp_metadata

FORMAT = "megatron_muon/1"
"""The ``format`` of our optimizer's common state, in every checkpoint format."""
READ_ERRORS = (Exception, torch.distributed.checkpoint.api.CheckpointException)
"""What a failed checkpoint read raises (torch's distributed-checkpoint errors derive from
BaseException, not Exception)."""
STATE_PREFIX = "optimizer.state."


# ---------------------------------------------------------------------------------------
# Optimizer state <-> model-coordinate tensors
# ---------------------------------------------------------------------------------------


def state_key(state: str, model_key: str) -> str:
    """The checkpoint key of one optimizer state of one model tensor."""
    return f"{STATE_PREFIX}{state}.{model_key}"


def state_names(opt, param) -> Tuple[str, ...]:
    """The states a checkpoint holds for ``param`` of one optimizer: its fp32 master
    (``param``), then the registry's enabled states (Muon matrix) or AdamW's."""
    return checkpoint_states(opt.config, id(param) in opt.muon_param_ids)


def model_param_metadata(model_sharded_state_dict) -> Dict[int, Any]:
    """id(param) -> its ShardedTensor / ShardedTensorFactory in the model's state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for value in nested_values(model_sharded_state_dict):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None:
            out[id(value.data)] = value
    return out


def held_in_place(opt) -> Iterator[Tuple[Any, str, Optional[torch.Tensor]]]:
    """(shard, state, the tensor holding this rank's range of it, or None) for every state
    of every param whose master this rank holds: the fp32 master, a per-shard state once
    allocated; None for one not allocated yet and for the owner-kept ones, which live per
    logical matrix on their owners."""
    owner_kept = {s.name for s in muon_states(opt.config, "owner")}
    for shard in opt.shard_map:
        if shard.master is None:
            continue
        state = opt.optimizer.state.get(shard.master, {})
        for name in state_names(opt, shard.param):
            yield shard, name, shard.master if name == MASTER else state.get(name) if name not in owner_kept else None


@torch.no_grad()
def shard_values(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    """id(param) -> {state: this rank's 1-D range of it} for every param whose master this
    rank holds (zeros for a state not allocated yet). Collective over the orthogonalization
    group when there are owner-kept states: the owners scatter them, expanded."""
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for shard, name, value in held_in_place(opt):
        values = out.setdefault(id(shard.param), {})
        values[name] = value if value is not None else torch.zeros_like(shard.master, dtype=torch.float32)
    for name in (s.name for s in muon_states(opt.config, "owner")):
        for (p, start, end), piece in opt.muon.owner_state_to_holders(name):
            out[id(opt.muon_params[p].param)][name][start:end] = piece
    return out


def params_in_order(opt) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(python key, param) for every param of ``opt``'s buffers, in a fixed order.

    The python keys only need to match between saving and loading in the same process
    (the checkpoint itself is keyed by ``ShardedTensor.key`` and offsets), so the buffer
    position is enough."""
    for i, param in enumerate(opt.shard_map.params):
        yield f"{opt.name}.{i}", param


def common_state(step: int, optimizers: Dict[str, Any], muon_config: Dict[str, Any]) -> Dict[str, Any]:
    """The non-tensor part of a Muon optimizer checkpoint, the one schema (the converter
    writes it too): format, successful steps, each optimizer's grad scaler and parameter
    groups (``MuonDistributedOptimizer.common_state``), the ``MuonConfig`` settings saved."""
    return {"format": FORMAT, "step": step, "optimizers": optimizers, "muon_config": muon_config}


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


def megatron_parts(common: Any) -> List[Any]:
    """Megatron's distributed optimizers in a checkpoint's common ``optimizer`` entry: one,
    or with expert parallelism the chained dense and expert ones (``{0: ..., 1: ...}``), in
    the chain's order."""
    if isinstance(common, dict) and common and all(isinstance(k, int) for k in common):
        return [common[k] for k in sorted(common)]
    return [common]


def optimizer_kind(common: Any) -> str:
    """Whose optimizer state a checkpoint's common ``optimizer`` entry is: ``megatron_muon``,
    ``megatron`` (Megatron's distributed optimizer, e.g. AdamW: its ``param_state_sharding_type``,
    or with expert parallelism its chained ``{0: ..., 1: ...}``), or ``none``."""
    if isinstance(common, dict) and common.get("format") == FORMAT:
        return "megatron_muon"
    if all(isinstance(p, dict) and "param_state_sharding_type" in p for p in megatron_parts(common)):
        return "megatron"
    return "none"


def require_ours(common: Any, where: str = "This checkpoint") -> None:
    """Refuse optimizer state whose common part (:func:`common_state`) is not ours, naming
    the conversion that makes it ours where there is one."""
    kind = optimizer_kind(common)
    if kind == "megatron_muon":
        return
    hint = (
        "it was written by Megatron's own distributed optimizer (AdamW): convert it with "
        "`python tools/convert_checkpoint.py adam-to-muon`"
        if kind == "megatron"
        else "it was not written by megatron_muon"
    )
    raise CheckpointError(f"{where} holds no Muon optimizer state of megatron_muon: {hint}")


def states_to_load(
    wanted: Mapping[str, Mapping[str, str]], saved: Collection[str], where: str
) -> Dict[str, Tuple[str, ...]]:
    """For each parameter (``{name: {state: checkpoint key}}``, what a run would read), the
    states to read from a checkpoint holding the keys ``saved``: every state it holds; an
    optional one it lacks (``state.MatrixState.required``) is left out and starts at zero;
    a required one it lacks (the fp32 master, AdamW's states, the momentum) is refused,
    naming it: the checkpoint is another optimizer's or model's."""
    out, missing = {}, []
    for name, states in wanted.items():
        out[name] = tuple(s for s, key in states.items() if key in saved)
        missing += [key for s, key in states.items() if key not in saved and required_in_checkpoint(s)]
    if missing:
        raise CheckpointError(
            f"{where} lacks {len(missing)} optimizer state tensor(s) this run loads ({', '.join(sorted(missing)[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): it was saved from another model or optimizer; load it with "
            "the flags it was trained with, or load the weights alone (--no-load-optim)"
        )
    return out


def saved_keys(checkpoint_dir: str) -> set:
    """Every key the checkpoint ``checkpoint_dir`` stores (its DCP metadata, read restricted),
    for :func:`states_to_load`."""
    return set(read_dcp_metadata(checkpoint_dir).state_dict_metadata)


def unused_state_prefixes(config) -> Tuple[str, ...]:
    """Checkpoint key prefixes of the registry's states this run does not use (a checkpoint
    saved with variance reduction holds ``second_moment``, a run without it ignores them)."""
    return tuple(state_key(s.name, "") for s in registry.MUON_STATES if not s.enabled(config))


def load_param_state(opt, param_state: Dict[str, Dict[str, torch.Tensor]], step: int) -> None:
    """Set ``opt``'s masters and states from ``param_state`` (python key -> {state: this
    rank's range of it})."""
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
            flat = tensors[key].reshape(-1).to(shard.master.device)
            current = shard.master if key == MASTER else state.get(key)
            if current is not None and current.data_ptr() == flat.data_ptr():
                continue  # read in place (``torch_dist.load_targets``)
            if key == MASTER:
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
        step_state.owner_state_from_holders(
            key, [pieces.get(id(m)) if m is not None else None for m in step_state.masters]
        )
    step_state.shard_states.adopt()
