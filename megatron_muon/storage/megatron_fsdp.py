"""Storage under Megatron-FSDP (ZeRO-3): where each rank's shards are, what the optimizer
requires of the wrapping, the storage backend itself (:class:`MegatronFSDPStorage`), and one
Megatron-FSDP defect it works around.

Megatron-FSDP (``megatron.core.distributed.FullyShardedDataParallel``) packs the parameters
of each *parameter group* (same dtype, dense or expert, one FSDP unit) into flat buffers
for the compute weights, the fp32 main weights and the gradients, all with one index: the
group's bucket is cut into ``dp_size`` equal contiguous shards and DP rank ``r`` keeps the
``r``-th (of the main weights and optimizer state always; of the gradients with
``optim_grads``; of the compute weights too with ``optim_grads_params``). That is the rule
of the DDP buffers under Megatron's distributed optimizer, so Muon's plan, ownership and
pipeline run unchanged on it: :func:`shard_ranges` evaluates Megatron-FSDP's own shard
function for every rank, and the backend takes this rank's fp32 masters from the optimizer
parameters Megatron-FSDP registers (``DTensor`` views of the main-weight shards). The
main-weight buffer is the master, the main-grad shard its gradient. No Megatron
``DistributedOptimizer`` is built here: the copies are Megatron-FSDP's own
(``copy_main_weights_to_model_weights``, ``zero_grad_buffer``), called by the backend.

A parameter may start in one rank's shard and end in the next (Megatron-FSDP aligns items
to the least common multiple of the group's row lengths, then packs): the Muon step moves
those pieces over the FSDP group to the rank that orthogonalizes the matrix, as it does on
Megatron's byte-level DDP layout.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch

from ..checkpoint.fsdp_dtensor import FSDP_DTENSOR
from ..megatron_fsdp_fix import SINGLE_RANK_GROUPS as SINGLE_RANK_GROUPS  # the defect's fix, here for callers
from ..megatron_fsdp_fix import (
    fix_gradient_accumulation_on_single_rank_groups as fix_gradient_accumulation_on_single_rank_groups,
)
from ..shard_map import FlatRange, ParamShard, ShardMap
from ..support import Settings
from ..timers import megatron_timer
from .backend import StorageBackend

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
"""The ``data_parallel_sharding_strategy`` values Muon runs on (``no_shard`` keeps every
parameter whole on every rank: use DDP with the distributed optimizer instead)."""


def is_megatron_fsdp(chunk: torch.nn.Module) -> bool:
    """Whether a model chunk is wrapped in Megatron-FSDP."""
    ddp_config = getattr(chunk, "ddp_config", None)
    return bool(getattr(ddp_config, "use_megatron_fsdp", False)) and hasattr(chunk, "param_and_grad_buffer")


def megatron_fsdp_requirements(ddp_config) -> List[str]:
    """The Megatron-FSDP settings under which the gradients Muon reads are wrong or not
    sharded, one refusal each, naming the fix. ``ddp_config``: a ``DistributedDataParallelConfig``
    or Megatron-LM's arguments (same names)."""
    refusals = []
    strategy = ddp_config.data_parallel_sharding_strategy
    if strategy not in STRATEGIES:
        refusals.append(
            f"Megatron-FSDP with data_parallel_sharding_strategy={strategy!r} is not supported; use "
            f"one of {', '.join(STRATEGIES)} (--data-parallel-sharding-strategy), or DDP with the distributed "
            "optimizer (drop --use-megatron-fsdp) to keep parameters unsharded"
        )
    if strategy == "optim" and not ddp_config.overlap_grad_reduce:
        # Megatron-FSDP 0.19 reduces 'optim' gradients twice without overlap: in the backward
        # hook of the last micro-batch and again in finish_grad_sync (AdamW is hit too).
        refusals.append(
            "Megatron-FSDP's 'optim' sharding reduces gradients twice (wrong values) unless "
            "DistributedDataParallelConfig.overlap_grad_reduce=True (--overlap-grad-reduce); set it"
        )
    if getattr(ddp_config, "pipeline_model_parallel_size", 1) > 1:
        # Megatron-LM's arguments only (a DDP config has no pipeline size): the library path
        # fails inside Megatron-FSDP's own constructor instead.
        refusals.append(
            "Megatron-FSDP in megatron-core 0.19 builds its device mesh over all ranks as "
            "DP x EP x TP, so pipeline parallelism fails inside it; use --pipeline-model-parallel-size 1 "
            "with --use-megatron-fsdp, or drop --use-megatron-fsdp"
        )
    if getattr(ddp_config, "megatron_fsdp_main_params_dtype", torch.float32) is None:
        refusals.append(
            "Megatron-FSDP without main weights (megatron_fsdp_main_params_dtype=None, --megatron-fsdp-main-params-dtype "
            "auto) would step "
            "the compute weights; keep megatron_fsdp_main_params_dtype=torch.float32 (--megatron-fsdp-main-params-dtype fp32)"
        )
    return refusals


def _shard_range(bucket_index, item_index, dp_size: int, dp_rank: int) -> FlatRange:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        _get_dp_buffer_shard_bucket_index,
    )

    shard = _get_dp_buffer_shard_bucket_index(bucket_index, True, dp_size, dp_rank)
    start, end = item_index.global_data_index, item_index.global_data_index + item_index.size
    lo, hi = max(start, shard.global_data_index), min(end, shard.global_data_index + shard.size)
    return (lo - start, hi - start) if hi > lo else (0, 0)


def shard_ranges(chunk: torch.nn.Module) -> List[Tuple[torch.nn.Parameter, Tuple[FlatRange, ...], int, object]]:
    """Every optimizer parameter of a Megatron-FSDP chunk, in buffer order: ``(param, each
    DP rank's range of its flat (TP-local) storage, this rank's DP rank, the DP group)``.

    ``param`` is the ``DTensor`` parameter Megatron-FSDP registers for the optimizer (the
    module's parameter outside forward and backward)."""
    buffer = chunk.param_and_grad_buffer
    optimizer_params = dict(buffer.optimizer_named_parameters)
    out = []
    for group in buffer.parameter_groups:
        main = group.main_weight_buffer
        for item_id, raw in enumerate(group.params):
            ranges = tuple(
                _shard_range(main.bucket_index, main.item_index_map[item_id], main.dp_world_size, r)
                for r in range(main.dp_world_size)
            )
            param = optimizer_params[buffer.param_to_name[raw]]
            held = main.get_item(item_id, only_shard=True).numel()
            mine = ranges[main.dp_rank]
            if held != mine[1] - mine[0]:
                raise RuntimeError(
                    f"Megatron-FSDP shard of {buffer.param_to_name[raw]} holds {held} elements on DP rank "
                    f"{main.dp_rank} but its shard index says {mine}: this megatron-core's layout is not the one "
                    "megatron_muon was written against."
                )
            out.append((param, ranges, main.dp_rank, main.data_parallel_group))
    return out


def local_flat(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a Megatron-FSDP ``DTensor`` (parameter or gradient), flat: a
    view, so writing it writes the main-weight buffer."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.detach().view(-1)


CARRIED_ATTRIBUTES = ("allreduce", "shared", "sequence_parallel")


def carry_parameter_attributes(chunks: Sequence[torch.nn.Module]) -> None:
    """Give Megatron-FSDP's ``DTensor`` parameters the attributes of the module parameters
    they stand for that Megatron's optimizer code reads: Megatron-FSDP copies the
    tensor-parallel ones but not ``allreduce`` (False marks expert-parallel parameters: the
    parameter groups and the grad norm's duplicate filter read it)."""
    for chunk in chunks:
        for _, param in chunk.param_and_grad_buffer.optimizer_named_parameters:
            raw = getattr(param, "orig_param", None)
            for attr in CARRIED_ATTRIBUTES:
                if raw is not None and hasattr(raw, attr) and not hasattr(param, attr):
                    setattr(param, attr, getattr(raw, attr))


def dp_groups(chunks: Sequence[torch.nn.Module]) -> Dict[bool, object]:
    """{is_expert: the FSDP data-parallel group} of the chunks' parameter groups."""
    groups = {}
    for chunk in chunks:
        for group in chunk.param_and_grad_buffer.parameter_groups:
            groups.setdefault(bool(group.is_expert_param), group.main_weight_buffer.data_parallel_group)
    return groups


# --------------------------------------------------------------------------------------
# The storage backend
# --------------------------------------------------------------------------------------


class MegatronFSDPStorage(StorageBackend):
    """Megatron-FSDP's flat buffers: the ``DTensor`` parameters it registers for the
    optimizer are the fp32 masters (this rank's main-weight shard), their ``.grad`` the
    main-grad shard (``--use-megatron-fsdp``)."""

    checkpoint_format = FSDP_DTENSOR

    @classmethod
    def step_overlap_refusal(cls, ddp_settings: Sequence[Any]) -> Optional[str]:
        return (
            "it runs on Megatron-DDP, not on Megatron-FSDP, whose parameter gather runs in pre-forward hooks of its "
            "own that megatron_muon does not hook"
        )

    @classmethod
    def wraps(cls, chunk: torch.nn.Module) -> bool:
        return is_megatron_fsdp(chunk)

    @classmethod
    def requirements(cls, settings: Settings) -> List[str]:
        refusals = super().requirements(settings)
        for ddp_config in settings.ddp[:1]:  # one wrapping for every chunk
            refusals += megatron_fsdp_requirements(ddp_config)
        optimizer = settings.optimizer
        if getattr(optimizer, "muon_cpu_offload", False) or getattr(optimizer, "optimizer_cpu_offload", False):
            refusals.append(
                "megatron_muon does not offload to the CPU on Megatron-FSDP (CPU offload: muon_cpu_offload / "
                "optimizer_cpu_offload, --muon-cpu-offload / --optimizer-cpu-offload), which already shards the fp32 "
                "masters, gradients and parameters over the data-parallel ranks: drop them"
            )
        return refusals

    @classmethod
    def check(cls, model_chunks: Sequence[torch.nn.Module], config) -> None:
        check_single_rank_groups(model_chunks)

    @classmethod
    def prepare(cls, model_chunks: Sequence[torch.nn.Module]) -> Dict[bool, Any]:
        """The optimizer holds the ``DTensor`` parameters Megatron-FSDP registers (modules
        hold them outside forward and backward, but the raw ones after a parameter
        all-gather), with the attributes Megatron's optimizer reads; each parameter group is
        sharded over its own FSDP group."""
        for chunk in model_chunks:
            chunk.module._replace_param_with_distributed_if_needed()
        carry_parameter_attributes(model_chunks)
        return dp_groups(model_chunks)

    def __init__(self, opt, data_parallel_group, data_parallel_group_gloo=None, data_parallel_group_idx=0) -> None:
        super().__init__(opt, data_parallel_group)
        self._param_names: Optional[Dict[torch.nn.Parameter, str]] = None
        self.muon_group_of: Dict[int, dict] = {}
        """id(DTensor parameter) -> its Muon group (its master may be absent here: an empty shard)."""
        self._hold_flat_masters()

    def build_shard_map(self) -> ShardMap:
        """Each DP rank's range from Megatron-FSDP's shard index; as this rank's master a
        flat view of its main-weight shard."""
        wanted = {id(mp.param) for mp in self.opt.muon_params}
        shards = []
        for chunk in self.opt.model_chunks:
            for param, ranges, dp_rank, _ in shard_ranges(chunk):
                if id(param) in wanted:
                    start, end = ranges[dp_rank]
                    master = local_flat(param) if end > start else None
                    shards.append(ParamShard(param, ranges, dp_rank, master))
        return ShardMap(shards)

    def _hold_flat_masters(self) -> None:
        """The Muon groups hold this rank's flat master shards instead of the ``DTensor``
        parameters (as Megatron's optimizer holds its shard masters), carrying the
        attributes Megatron's grad norm reads (TP duplicates, shared weights)."""
        from megatron.core.optimizer.optimizer import GRAD_NORM_GROUP_ATTR
        from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

        for group in self.opt.optimizer.muon_groups:
            masters = []
            for param in group["params"]:
                self.muon_group_of[id(param)] = group
                master = self.shard_map.master(param)
                if master is None:
                    continue
                copy_tensor_model_parallel_attributes(master, param)
                for attr in ("shared", "allreduce", GRAD_NORM_GROUP_ATTR):
                    if hasattr(param, attr):
                        setattr(master, attr, getattr(param, attr))
                masters.append(master)
            group["params"] = masters

    def float16_masters(self) -> List[torch.Tensor]:
        # The DTensor parameters are the fp32 main weights; the model's dtype is the module
        # parameter's (``orig_param``).
        float16 = (mp.param for mp in self.opt.muon_params if mp.param.orig_param.dtype != torch.float32)
        return [m for m in map(self.shard_map.master, float16) if m is not None]

    def copy_grads_to_masters(self) -> List[torch.Tensor]:
        """Megatron-FSDP has set each ``DTensor`` parameter's ``.grad`` to its gradient
        shard: a flat view of it becomes the master's."""
        for shard in self.shard_map:
            if shard.master is not None:
                grad = shard.param.grad
                shard.master.grad = local_flat(grad) if grad is not None else torch.zeros_like(shard.master)
        params = (p for g in self.opt.optimizer.param_groups for p in g["params"])
        return [local_flat(p.grad) for p in params if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Megatron-FSDP zeroes its gradient buffers (what Megatron's distributed optimizer
        asks of it); the masters' gradients, views of them, are dropped."""
        for chunk in self.opt.model_chunks:
            chunk.zero_grad_buffer()
        for shard in self.shard_map:
            if shard.master is not None:
                shard.master.grad = None

    def copy_masters_to_model(self, params: Optional[Collection[int]] = None) -> None:
        """Megatron-FSDP's copy of its main weights into the compute weights (what Megatron's
        distributed optimizer asks of it); one copy covers the dense and the expert
        parameters of a chunk, so the dense optimizer makes it. Never for a subset: the step
        does not overlap on Megatron-FSDP (:meth:`step_overlap_refusal`)."""
        if params is not None:
            raise NotImplementedError("Megatron-FSDP copies every parameter at once.")
        if self.opt.name == "dense":
            for chunk in self.opt.model_chunks:
                chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()

    def copy_model_to_masters(self, state_dict=None) -> None:
        raise NotImplementedError("Megatron-FSDP does not implement a model-to-main parameter update.")

    def start_param_sync(self) -> None:
        """Megatron-FSDP gathers (or, overlapping, prepares to gather) every parameter group
        of a chunk, dense and expert: once, from the dense optimizer."""
        if self.opt.name == "dense":
            with megatron_timer(self.opt.config, "params-all-gather"):
                for chunk in self.opt.model_chunks:
                    chunk.start_param_sync()

    def param_name(self, param: torch.nn.Parameter) -> str:
        """The chunks' parameter names with the experts numbered globally by Megatron's own
        ``handle_experts_in_state_dict`` (as its distributed optimizer names them)."""
        if self._param_names is None:
            from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

            named: Dict[str, torch.nn.Parameter] = {}
            for chunk in self.opt.model_chunks:
                named.update(chunk.named_parameters())
            named = handle_experts_in_state_dict(named, self.opt.model_chunks[0].config.num_moe_experts)
            self._param_names = {p: n for n, p in named.items()}
        return self._param_names[param]


# --------------------------------------------------------------------------------------
# A Megatron-FSDP defect (megatron-core 0.19.2, any device)
# --------------------------------------------------------------------------------------


def check_single_rank_groups(chunks: Sequence[torch.nn.Module], where: str = "get_muon_optimizer") -> None:
    """Refuse chunks whose gradients Megatron-FSDP accumulates wrong (see
    :func:`fix_gradient_accumulation_on_single_rank_groups`)."""
    for chunk in chunks:
        if chunk.ddp_config.data_parallel_sharding_strategy not in ("optim_grads", "optim_grads_params"):
            continue
        for group in chunk.param_and_grad_buffer.parameter_groups:
            grads = group.main_grad_buffer
            if grads is not None and grads.dp_world_size == 1 and not grads.is_data_distributed:
                raise ValueError(
                    f"{where}: Megatron-FSDP built an unsharded gradient buffer for a one-rank data-parallel "
                    "group (expert_model_parallel_size equal to the data-parallel size): it scales earlier "
                    "micro-batches' gradients again at every later one. Call "
                    "megatron_muon.storage.megatron_fsdp.fix_gradient_accumulation_on_single_rank_groups() before "
                    "wrapping the model in FullyShardedDataParallel."
                )
