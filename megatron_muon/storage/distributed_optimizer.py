"""Storage under Megatron's ``DistributedDataParallel`` with the distributed optimizer: the
DDP buffers hold the model's parameters and reduce-scattered gradients, a Megatron
``DistributedOptimizer`` that this backend builds and holds (:attr:`DistributedOptimizerStorage.engine`)
this rank's fp32 masters of its shard of every bucket.

The engine is Megatron's own class, built as ``get_megatron_optimizer`` builds it, over the
``MuonDistributedOptimizer``'s torch optimizer: its constructor cuts the buffers into
per-rank ranges and replaces the parameter groups' parameters by fp32 master shards, and its
methods make the copies (grads -> masters, masters -> model, model -> masters) and name the
parameters. Held rather than inherited: the Muon optimizer is a Megatron
``MixedPrecisionOptimizer`` on every engine, and only this module knows a DDP buffer. This
backend adds the CPU-offloaded masters' gradient placeholders, a copy of a subset of the
masters (the step overlap), and all-gathers only the bucket groups of its own optimizer's
buffers.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Collection, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ..buffer_layout import is_owner_aligned, prefetch_param_gathers_in_forward_order
from ..checkpoint.torch_dist import TORCH_DIST
from ..shard_map import ParamShard, ShardMap, dp_ranges_in_layout
from ..timers import megatron_timer
from .backend import StorageBackend

logger = logging.getLogger(__name__)


class PendingStepFirst:
    """A DDP bucket group's ``start_param_sync`` under ``muon_step_overlap='forward'``: the
    pending step's work on the group's parameters first (``pipeline.PendingStep.before_sync``:
    their chunks, QK-Clip's scaling, the master -> model copy), then Megatron's own
    ``start_param_sync`` (the group's all-gather)."""

    def __init__(self, megatron_start_param_sync: Callable[..., Any], pending: Any, index: int) -> None:
        self.megatron_start_param_sync = megatron_start_param_sync
        self.pending = pending
        self.index = index

    def __call__(self, force_sync: bool = False) -> Any:
        self.pending.before_sync(self.index)
        return self.megatron_start_param_sync(force_sync=force_sync)


def _gathers_quantized(ddp_settings: Any) -> bool:
    """Whether DDP gathers the parameters in FP8 / FP4 (``ddp_config``, or Megatron-LM's
    arguments, which carry the same names): Megatron then quantizes the masters into the
    parameter buffer instead of copying them."""
    return bool(getattr(ddp_settings, "fp8_param_gather", False) or getattr(ddp_settings, "fp4_param_gather", False))


class DistributedOptimizerStorage(StorageBackend):
    """Megatron's DDP buffers and distributed-optimizer masters (``--use-distributed-optimizer``)."""

    checkpoint_format = TORCH_DIST

    @classmethod
    def wraps(cls, chunk: torch.nn.Module) -> bool:
        return hasattr(chunk, "buffers") and getattr(chunk, "ddp_config", None) is not None

    @classmethod
    def check(cls, model_chunks: Sequence[torch.nn.Module], config) -> None:
        for i, chunk in enumerate(model_chunks):
            if not cls.wraps(chunk):
                raise TypeError(
                    f"get_muon_optimizer: model chunk {i} ({type(chunk).__name__}) is not wrapped in "
                    "megatron.core.distributed.DistributedDataParallel. Wrap every chunk with "
                    "DistributedDataParallel(config, DistributedDataParallelConfig("
                    "use_distributed_optimizer=True), module=chunk) first."
                )

    @staticmethod
    def chunk_buffers(model_chunks: Sequence[torch.nn.Module], expert: bool) -> Dict[int, list]:
        """Each DDP chunk's ``buffers`` (``expert_parallel_buffers``), as Megatron's
        ``get_megatron_optimizer`` hands them to its ``DistributedOptimizer``."""
        buffers = (
            (i, chunk.expert_parallel_buffers if expert else chunk.buffers) for i, chunk in enumerate(model_chunks)
        )
        return {i: b for i, b in buffers if b}

    @classmethod
    def owner_aligned(cls, config, model_chunks: Sequence[torch.nn.Module]) -> bool:
        """'owner_aligned' asked but DDP built without the layout: the step is still exact on
        Megatron's byte-level layout, only with DP traffic, so warn (naming the fix)."""
        aligned = is_owner_aligned(model_chunks)
        if config.muon_buffer_layout == "owner_aligned" and not aligned:
            logger.warning(
                "get_muon_optimizer: muon_buffer_layout='owner_aligned' but DDP was built without "
                "megatron_muon.owner_aligned_param_layout(); running on Megatron's byte-level layout (Muon "
                "pieces then travel over DP). Pass DistributedDataParallel(..., full_param_layout="
                "owner_aligned_param_layout(config, chunk, ddp_config)) or set muon_buffer_layout='megatron'."
            )
        return aligned

    @classmethod
    def step_overlap_refusal(cls, ddp_settings: Sequence[Any]) -> Optional[str]:
        if not all(d.overlap_param_gather for d in ddp_settings):
            return (
                "it needs --overlap-param-gather (DistributedDataParallelConfig(overlap_param_gather=True), with "
                "--overlap-grad-reduce): the step finishes as each bucket group's parameter all-gather starts, "
                "which DDP overlaps with the forward only then"
            )
        if any(_gathers_quantized(d) for d in ddp_settings):
            # copy_masters_to_model(params) copies; Megatron quantizes a whole optimizer's shards at once
            return (
                "the copy of one bucket group's masters does not quantize FP8 / FP4 parameters "
                "(--fp8-param-gather / --fp4-param-gather)"
            )
        return None

    def __init__(self, opt, data_parallel_group, data_parallel_group_gloo=None, data_parallel_group_idx=0) -> None:
        self.engine = DistributedOptimizer(
            opt.optimizer,
            opt.config,
            opt.grad_scaler,
            opt.init_state_fn,
            opt.model_chunks,
            self.chunk_buffers(opt.model_chunks, expert=opt.name == "expert"),
            data_parallel_group,
            data_parallel_group_gloo,
            data_parallel_group_idx,
            0,
        )
        """Megatron's distributed optimizer over ``opt``'s torch optimizer: the ranges of the
        buffers, the fp32 master shards, the copies."""
        # The plan's DP group is the buffers' own (Megatron's intra-instance group).
        buffers = self.engine.buffers
        super().__init__(opt, buffers[0].data_parallel_group if buffers else data_parallel_group)
        prefetch_param_gathers_in_forward_order(opt.model_chunks)

    def build_shard_map(self) -> ShardMap:
        """Megatron's DDP buffers say who holds what; its master groups hold this rank's
        fp32 masters (``shard_fp32_from_float16_groups`` / ``shard_fp32_groups``)."""
        engine = self.engine
        masters = {}
        for models, mains in zip(engine.model_float16_groups, engine.shard_fp32_from_float16_groups):
            masters.update({id(m): s for m, s in zip(models, mains)})
        for models, mains in zip(engine.model_fp32_groups, engine.shard_fp32_groups):
            masters.update({id(m): s for m, s in zip(models, mains)})
        shards = []
        for buffer in engine.buffers:
            group = buffer.data_parallel_group
            size, rank = group.size(), group.rank()
            for param in buffer.param_index_map:
                ranges = tuple(dp_ranges_in_layout(buffer, param, size))
                shards.append(ParamShard(param, ranges, rank, masters.get(id(param))))
        return ShardMap(shards)

    def float16_masters(self) -> List[torch.Tensor]:
        float16 = {id(m) for group in self.engine.shard_fp32_from_float16_groups for m in group}
        masters = (self.shard_map.master(mp.param) for mp in self.opt.muon_params)
        return [m for m in masters if m is not None and id(m) in float16]

    def model_ranges(self, masters: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Each master's range of its bucket's parameter buffer, where Megatron's copy writes
        it; None for all with FP8 / FP4 parameter gathers (Megatron quantizes the masters)."""
        if _gathers_quantized(self.engine.ddp_config):
            return [None for _ in masters]
        params = {id(shard.master): shard.param for shard in self.shard_map if shard.master is not None}
        return [self._model_range(params[id(master)]) for master in masters]

    def _model_range(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's range of ``param`` in its bucket's parameter buffer (Megatron's
        ``gbuf_world_in_bucket``): what the master -> model copy writes and the all-gather sends."""
        world = self.engine._get_model_param_range_map(param)["gbuf_world_in_bucket"]
        buffer_index, _, bucket_index = self.engine.model_param_gbuf_map[param]
        return self.engine.buffers[buffer_index].buckets[bucket_index].param_data.view(-1)[world.start : world.end]

    def copy_grads_to_masters(self) -> List[torch.Tensor]:
        """Megatron's copy; the CPU-offloaded masters take their gradients through their
        device placeholders."""
        offload = self.opt.masters_offload
        with offload.grads_assignable() if offload is not None else contextlib.nullcontext():
            self.engine._copy_model_grads_to_main_grads()
        return self.engine._collect_main_grad_data_for_unscaling()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def copy_masters_to_model(self, params: Optional[Collection[int]] = None) -> None:
        """Megatron's copy (CPU-offloaded masters: nothing to copy where the step wrote them
        into the model's parameters on the device, ``OffloadedMasters.model_ranges_in_place``,
        else from a pinned pool in the model's dtype, ``OffloadedMasters.in_model_dtype``);
        for a subset of the parameters, the same copy of each into its range of the bucket's
        parameter buffer (what Megatron's all-gather then sends).
        Megatron has no per-parameter copy; the subset path is its plain (unquantized) one,
        so the step overlap that uses it is refused with FP8 / FP4 parameter gathers."""
        engine = self.engine
        if params is None:
            offload = self.opt.masters_offload
            dtype = next((p.dtype for group in engine.model_float16_groups for p in group), None)
            if offload is not None and offload.model_written:
                in_model = offload.model_ranges_in_place()
            elif offload is not None and dtype:
                in_model = offload.in_model_dtype(dtype)
            else:
                in_model = contextlib.nullcontext()
            with in_model:
                engine._copy_main_params_to_model_params()
            return
        groups = zip(
            engine.shard_fp32_from_float16_groups + engine.shard_fp32_groups,
            engine.model_float16_groups + engine.model_fp32_groups,
        )
        for masters, models in groups:
            for master, param in zip(masters, models):
                if id(param) not in params:
                    continue
                self._model_range(param).copy_(master)

    def copy_model_to_masters(self, state_dict=None) -> None:
        self.engine._copy_model_params_to_main_params(state_dict)

    def own_bucket_groups(self) -> List[Tuple[Any, Any]]:
        """(model chunk, bucket group) of every DDP bucket group built from this optimizer's
        own buffers (dense or expert-parallel), in model-chunk order."""
        mine = {id(bucket) for buffer in self.engine.buffers for bucket in buffer.buckets}
        return [
            (model_chunk, bucket_group)
            for model_chunk in self.opt.model_chunks
            for bucket_group in model_chunk.bucket_groups + model_chunk.expert_parallel_bucket_groups
            if any(id(bucket) in mine for bucket in bucket_group.buckets)
        ]

    def start_param_sync(self) -> None:
        """All-gather the parameters of the bucket groups built from this optimizer's own
        buffers (dense or expert-parallel); left to DDP when it overlaps the gather with the
        next forward (``overlap_param_gather``).

        Megatron's ``start_param_sync_for_bucket_group_subset`` walks every bucket group of
        every model chunk, skipping only those tagged ``is_managed_by_layer_wise_optimizer``;
        ours tags its owner-aligned buffers the same way and updates them itself, so the tag
        says nothing here. Walking every group would all-gather each one once per chained
        optimizer: twice per step with experts."""
        if self.engine.ddp_config.overlap_param_gather:
            return
        groups = self.own_bucket_groups()
        with megatron_timer(self.opt.config, "params-all-gather"):
            for model_chunk, bucket_group in groups:
                model_chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    def param_sync_units(self) -> List[Tuple[Any, FrozenSet[int]]]:
        """DDP's bucket groups of this optimizer's buffers."""
        return [(group, frozenset(id(p) for p in group.params)) for _, group in self.own_bucket_groups()]

    def hook_param_sync(self, unit: Any, pending: Any, index: int) -> None:
        """Every all-gather of a bucket group starts in its ``start_param_sync`` (DDP's
        forward pre-hook and its prefetch of the next group, the pipeline schedules'
        ``param_sync_func``, the forced syncs before evaluation and checkpoints): it becomes
        a :class:`PendingStepFirst` (a later optimizer's replaces an earlier one's)."""
        current = unit.start_param_sync
        megatron_start = current.megatron_start_param_sync if isinstance(current, PendingStepFirst) else current
        unit.start_param_sync = PendingStepFirst(megatron_start, pending, index)

    def param_name(self, param: torch.nn.Parameter) -> str:
        return self.engine._param_name(param)
