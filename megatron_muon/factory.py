"""``get_muon_optimizer``: build the Muon optimizer for Megatron DDP- or Megatron-FSDP-wrapped
model chunks.

Mirrors ``megatron.core.optimizer.get_megatron_optimizer`` for the distributed optimizer:
parameter groups come from Megatron's own grouping (weight-decay and learning-rate
overrides, ``config_overrides``), dense and expert-parallel parameters get one optimizer
each over their own DDP buffers and data-parallel groups, and the two are chained.
Within each group, Muon matrices and scalar parameters are separated into sibling groups
with identical settings, flagged ``muon=True`` / ``False``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Type

import torch
from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.process_groups_config import ProcessGroupCollection

from .config import MuonConfig
from .matrices import check_exclude_patterns_match, collect_muon_params
from .optimizer import MuonAdamW, MuonChainedOptimizer, MuonDistributedOptimizer
from .pipeline import step_overlap_mode
from .process_groups import parallel_groups
from .qk_clip import QKClip
from .storage import StorageBackend, storage_for
from .support import Settings, refusals


def _check_precision(model_chunks: List[torch.nn.Module], config: MuonConfig) -> None:
    """The optimizer's precision must be the model's: an fp16 model stepped by a non-fp16
    config would get no loss scaler (and a bf16 model's params would be treated as fp32)."""
    model_config = model_chunks[0].config  # the wrapper's TransformerConfig (either engine)
    for flag in ("fp16", "bf16"):
        model_value = bool(getattr(model_config, flag))
        if model_value != bool(getattr(config, flag)):
            raise ValueError(
                f"get_muon_optimizer: the model has TransformerConfig.{flag}={model_value} but "
                f"MuonConfig.{flag}={getattr(config, flag)}; set MuonConfig({flag}={model_value}) "
                "so the optimizer uses the model's precision (fp16 needs its loss scaler)."
            )


def _check_model_chunks(model_chunks: List[torch.nn.Module], config: MuonConfig) -> Type[StorageBackend]:
    """Refuse what the optimizer cannot run (naming the fix); the chunks' storage backend."""
    if not model_chunks:
        raise ValueError("get_muon_optimizer: model_chunks is empty.")
    storage = storage_for(model_chunks)
    storage.check(model_chunks, config)
    _check_precision(model_chunks, config)
    for refusal in refusals(Settings.of(config, model_chunks), storage):
        raise ValueError(f"get_muon_optimizer: {refusal}.")
    return storage


def _grad_scaler(config: MuonConfig):
    """Exactly Megatron's choice: constant if ``loss_scale`` is set, dynamic for fp16."""
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def _split_groups(param_groups: List[dict], muon_ids: set) -> List[dict]:
    """Each Megatron group becomes a scalar group and a Muon group with the same settings.

    Both siblings exist on every rank (possibly empty), so groups line up across ranks.
    """
    out = []
    for group in param_groups:
        for is_muon in (False, True):
            sibling = dict(group)
            sibling["params"] = [p for p in group["params"] if (id(p) in muon_ids) == is_muon]
            sibling["muon"] = is_muon
            out.append(sibling)
    return out


def get_muon_optimizer(
    config: MuonConfig,
    model_chunks: List[torch.nn.Module],
    pg_collection: Optional[ProcessGroupCollection] = None,
    config_overrides: Optional[Dict] = None,
    use_gloo_process_groups: bool = True,
) -> MuonChainedOptimizer:
    """Build the Muon optimizer for Megatron DDP-wrapped ``model_chunks``.

    Drop-in for ``get_megatron_optimizer(OptimizerConfig(optimizer='adam',
    use_distributed_optimizer=True, ...), model_chunks)``: the returned optimizer has the
    same interface (``step()`` -> (update_successful, grad_norm, num_zeros_in_grad),
    ``zero_grad``, ``get_loss_scale``, ``state_dict``...).
    """
    if not isinstance(config, MuonConfig):
        raise TypeError("get_muon_optimizer expects a megatron_muon.MuonConfig (it extends OptimizerConfig).")
    storage = _check_model_chunks(model_chunks, config)
    step_overlap = step_overlap_mode(config, model_chunks, storage)
    engine_dp_groups = storage.prepare(model_chunks)
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)

    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
        pg_collection, model_chunks, use_gloo_process_groups
    )
    parallel = parallel_groups(pg_collection)

    owner_aligned = storage.owner_aligned(config, model_chunks)
    check_exclude_patterns_match(model_chunks, config)
    muon_params, _ = collect_muon_params(model_chunks, config, (parallel.tp.size(), parallel.expt_tp.size()))
    muon_ids = {id(mp.param) for mp in muon_params}
    all_groups = _split_groups(_get_param_groups(model_chunks, config, config_overrides), muon_ids)

    optimizers = []
    for expert in (False, True):
        param_groups = [g for g in all_groups if g["is_expert_parallel"] == expert]
        if not any(g["params"] for g in param_groups) and expert:
            continue
        if expert:
            dp_group, dp_gloo = groups["intra_expt_dp_group"], groups["intra_expt_dp_group_gloo"]
            mp_rank = groups["expt_tp_pp_group"].rank()
            ortho_tp = parallel.expt_tp
        else:
            dp_group, dp_gloo = groups["intra_dp_cp_group"], groups["intra_dp_cp_group_gloo"]
            mp_rank = groups["mp_group"].rank()
            ortho_tp = parallel.tp
        dp_group = engine_dp_groups.get(expert, dp_group)  # the same ranks
        params = {id(p) for g in param_groups for p in g["params"]}
        opt = MuonDistributedOptimizer(
            MuonAdamW(param_groups, config),
            config,
            _grad_scaler(config),
            model_chunks,
            dp_group,
            dp_gloo,
            mp_rank,
            ortho_tp,
            [mp for mp in muon_params if id(mp.param) in params],
            name="expert" if expert else "dense",
            qk_clip=None if expert else QKClip.from_model(model_chunks, groups["dp_cp_group"], groups["mp_group"]),
            owner_aligned=owner_aligned,
            storage=storage,
            grad_stats_parallel_group=groups["intra_dist_opt_group"],
            grad_norm_tp_groups=(parallel.tp, parallel.expt_tp),
        )
        optimizers.append(opt)
    return MuonChainedOptimizer(optimizers, step_overlap)
