"""Owner-aligned DDP buffers: every Muon matrix lands, whole, in the DP shard of its owner.

Megatron DDP lays parameters out in contiguous buffers, and the distributed optimizer gives
DP rank ``r`` the ``r``-th equal slice (shard) of every bucket. With Megatron's byte-level
layout the shard bounds cut through matrices, so an exact Muon must move pieces across DP
ranks. Megatron-core 0.19 lets the optimizer choose the layout
(``DistributedDataParallel(full_param_layout=...)``); this module computes ours:

* Muon matrix parameters are tagged ``is_managed_by_layer_wise_optimizer`` (Megatron's own
  routing attribute) so DDP puts them in buffers of their own, dense and expert apart; the
  scalar (AdamW) parameters keep ``DistributedOptimizer``'s byte-level layout in theirs.
* In a Muon buffer, every bucket is cut into ``dp`` equal shards of ``C`` elements and
  whole parameters are packed into them: largest Newton–Schulz cost first, each to the
  shard with the least Newton–Schulz load among those it still fits in, so the shards hold
  equal bytes (they are all ``C`` long) and balanced Newton–Schulz FLOPs. A parameter
  larger than a shard is the one exception: it is laid out across consecutive shards,
  inside one node where it fits there. ``C`` starts at the bucket's mean shard size and
  grows by 1 % until everything fits; where that would pad more than 2 % (few params per
  shard), whole params are packed per node instead (they may then cross a shard bound, never
  a node bound).
* Every TP rank computes the same layout from the same local shapes, so each TP piece of
  a matrix sits at the same DP index on every TP rank: the DP reduce-scatter delivers a
  matrix to the DP index that owns it, and Muon only moves TP pieces inside the TP group.

``owner_aligned_param_layout`` is the public entry point (call it on each un-wrapped model chunk and
pass the result to DDP); ``get_muon_optimizer`` recognises the layout (``OwnerAlignedParamLayout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.param_layout import (
    FullParamLayout,
    PerBufferParamLayout,
    bucket_end_divisor,
    pad_param_start,
    pad_to_divisor,
)

from .config import MuonConfig
from .newton_schulz import method_for_device, newton_schulz_flops
from .process_groups import gpus_per_node as local_gpus_per_node
from .process_groups import parallel_groups

GROWTH = 1.01
"""Shard capacity grows by this factor while the parameters do not fit."""

PARAMS_PER_SHARD = 8
"""A bucket closes once each of its shards has room for this many of its largest params
(or at DDP's bucket size, whichever is larger): whole params then pack with little padding."""

WHOLE_PARAM_SLACK = 0.02
"""Padding (fraction of a bucket) accepted to keep every param whole in one shard before
falling back to whole params per node (see ``_pack_bucket``)."""


@dataclass
class OwnerAlignedParamLayout(FullParamLayout):
    """A ``FullParamLayout`` computed by :func:`owner_aligned_param_layout` (owner-aligned Muon buffers)."""


def owner_aligned_param_layout(
    config: MuonConfig,
    model_chunk: torch.nn.Module,
    ddp_config,
    disable_bucketing: bool = False,
    pg_collection=None,
    gpus_per_node: Optional[int] = None,
) -> OwnerAlignedParamLayout:
    """The owner-aligned ``full_param_layout`` for one un-wrapped model chunk.

    Build every chunk's layout with the same ``config`` and ``ddp_config`` you then give
    ``DistributedDataParallel`` and ``get_muon_optimizer``::

        layout = owner_aligned_param_layout(config, chunk, ddp_config, disable_bucketing=i > 0)
        DistributedDataParallel(tf_config, ddp_config, chunk, disable_bucketing=i > 0,
                                full_param_layout=layout)

    Tags the chunk's Muon parameters (``is_managed_by_layer_wise_optimizer = True``) so DDP
    routes them to their own buffers. Bucket size, DP sizes and TP sizes are taken exactly
    as DDP and ``get_muon_optimizer`` take them (``pg_collection`` or Megatron's
    ``parallel_state``). ``gpus_per_node`` (default: torchrun's ``LOCAL_WORLD_SIZE``, else
    the visible GPUs) keeps a matrix that must straddle DP shards inside one node where it
    can (Megatron orders ranks TP, CP, EP fastest, then DP).
    """
    from .matrices import collect_muon_params

    groups = parallel_groups(pg_collection)
    dp_size, edp_size = groups.intra_dp_cp.size(), groups.intra_expt_dp.size()
    tp_size, etp_size = groups.tp.size(), groups.expt_tp.size()
    if gpus_per_node is None:
        gpus_per_node = local_gpus_per_node()
    bucket_size = ddp_config.bucket_size
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * dp_size)  # DDP's default
    if not ddp_config.overlap_grad_reduce or disable_bucketing or groups.pp_rank > 0:
        bucket_size = None

    muon_params, _ = collect_muon_params([model_chunk], config, (tp_size, etp_size))
    method = method_for_device(config.muon_ns_method, muon_params[0].param.device if muon_params else None)
    flops = {mp.param: muon_param_flops(mp, config.muon_num_ns_steps, method) for mp in muon_params}
    tag_muon_params(flops)
    params = [p for p in model_chunk.parameters() if p.requires_grad]
    return compute_full_param_layout(
        params,
        flops,
        bucket_size,
        dp_size,
        ddp_config,
        edp_size,
        shards_per_node=(
            max(1, gpus_per_node // (tp_size * groups.cp_size)),
            max(1, gpus_per_node // (etp_size * groups.ep_size)),
        ),
    )


def muon_param_flops(muon_param, ns_steps: int, ns_method: str = "standard") -> int:
    """Newton–Schulz FLOPs of all logical matrices of one parameter (full shapes), counted
    for the iteration ``ns_method`` runs on each (as the planner counts them)."""
    return sum(
        newton_schulz_flops(*m.ns_shape, ns_steps, batch=m.column_groups, method=ns_method) for m in muon_param.matrices
    )


def tag_muon_params(params: Sequence[torch.nn.Parameter]) -> None:
    """Route ``params`` to DDP buffers of their own (Megatron's buffer-routing attribute)."""
    for param in params:
        param.is_managed_by_layer_wise_optimizer = True


def compute_full_param_layout(
    params: List[torch.nn.Parameter],
    flops: Dict[torch.nn.Parameter, int],
    bucket_size: Optional[int],
    data_parallel_world_size: int,
    ddp_config,
    expert_data_parallel_world_size: Optional[int] = None,
    shards_per_node: Tuple[int, int] = (1, 1),
) -> OwnerAlignedParamLayout:
    """Like ``DistributedOptimizer.compute_full_param_layout``: one layout per DDP buffer,
    owner-aligned for the tagged (Muon) buffers, Megatron's byte-level for the rest.
    ``shards_per_node``: consecutive (dense, expert) DP shards that share a node."""
    layouts = {}
    for key, (group_params, param_indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        dp = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            dp = expert_data_parallel_world_size
        if key.is_managed_by_layer_wise_optimizer:
            layouts[key] = owner_aligned_buffer_layout(
                group_params,
                lambda p: flops.get(p, 0),
                bucket_size,
                dp,
                ddp_config,
                param_indices,
                shards_per_node[1 if key.is_expert_parallel else 0],
            )
        else:
            layouts[key] = DistributedOptimizer._compute_per_buffer_param_layout(
                group_params, bucket_size, dp, ddp_config, param_indices
            )
    return OwnerAlignedParamLayout(layouts=layouts)


def owner_aligned_buffer_layout(
    params: List[torch.nn.Parameter],
    cost: Callable[[torch.nn.Parameter], int],
    bucket_size: Optional[int],
    dp_size: int,
    ddp_config,
    param_indices: Optional[List[int]] = None,
    shards_per_node: int = 1,
) -> PerBufferParamLayout:
    """Whole parameters packed into equal DP shards, balanced by ``cost`` (NS FLOPs).

    Buckets follow backprop order as in Megatron's layouts (so ``overlap_grad_reduce`` still
    overlaps); a bucket closes once it holds ``max(bucket_size, PARAMS_PER_SHARD x dp x its
    largest param)`` elements, so most parameters are small next to a shard.
    ``shards_per_node``: consecutive DP shards on one node; a param larger than a shard is
    kept inside one node's shards where it fits there.
    """
    shard_divisor = math.lcm(64, bucket_end_divisor(dp_size, ddp_config.pad_buckets_for_high_nccl_busbw) // dp_size)
    param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}
    bucket_indices: List[Tuple[int, int]] = []
    unpadded: List[int] = []
    loads = [0] * dp_size  # NS FLOPs per shard, over all buckets so far

    def emit(chunk: List[torch.nn.Parameter]) -> None:
        if not chunk:
            return
        start = bucket_indices[-1][1] if bucket_indices else 0
        capacity, placement = _pack_bucket(chunk, cost, dp_size, shard_divisor, shards_per_node, loads)
        for param, offset in placement.items():
            param_index_map[param] = (start + offset, start + offset + param.numel(), len(bucket_indices))
        bucket_indices.append((start, start + dp_size * capacity))
        unpadded.append(sum(p.numel() for p in chunk))

    chunk: List[torch.nn.Parameter] = []
    numel = largest = 0
    for param in reversed(params):
        chunk.append(param)
        numel += param.numel()
        largest = max(largest, param.numel())
        if bucket_size is not None and numel >= max(bucket_size, PARAMS_PER_SHARD * dp_size * largest):
            emit(chunk)
            chunk, numel, largest = [], 0, 0
    emit(chunk)
    return PerBufferParamLayout(
        param_index_map=param_index_map,
        bucket_indices=bucket_indices,
        per_bucket_numel_unpadded=unpadded,
        param_indices=param_indices if param_indices is not None else [],
        num_optimizer_shards=dp_size,
    )


def _pack_bucket(
    params: List[torch.nn.Parameter],
    cost: Callable[[torch.nn.Parameter], int],
    dp: int,
    divisor: int,
    shards_per_node: int = 1,
    loads: Optional[List[int]] = None,
) -> Tuple[int, Dict[torch.nn.Parameter, int]]:
    """(shard size, offset of each param in the bucket); adds the params' costs to the
    shards' running ``loads`` (so balance holds over all buckets, not each alone).

    Whole params per shard, at the smallest shard size (from the mean up, in 1 % steps)
    where they fit. Where that would cost more than ``WHOLE_PARAM_SLACK`` of padding (few
    params per shard, e.g. the dense layers at DP128) and shards share nodes, whole params
    are packed per node instead (a node's shards are one contiguous range of the bucket):
    a param may then straddle shard bounds, but only inside a node.
    """
    total = sum(pad_param_start(p.numel()) for p in params)
    mean = pad_to_divisor(max(-(-total // dp), 1), divisor)
    per_node = shards_per_node if shards_per_node > 1 and dp % shards_per_node == 0 else 1
    loads = loads if loads is not None else [0] * dp
    node_loads = [sum(loads[n * per_node : (n + 1) * per_node]) for n in range(dp // per_node)]
    capacity, placement = mean, None
    while placement is None and (per_node == 1 or capacity <= mean * (1 + WHOLE_PARAM_SLACK)):
        placement = _try_pack(params, cost, dp, capacity, per_node, loads)
        if placement is None:
            capacity = pad_to_divisor(int(capacity * GROWTH) + 1, divisor)
    if placement is None:
        capacity = mean
        while placement is None:
            placement = _try_pack(params, cost, dp // per_node, capacity * per_node, 1, node_loads)
            if placement is None:
                capacity = pad_to_divisor(int(capacity * GROWTH) + 1, divisor)
    for param, offset in placement.items():
        loads[(offset + param.numel() // 2) // capacity] += cost(param)
    return capacity, placement


def _try_pack(
    params: List[torch.nn.Parameter],
    cost: Callable[[torch.nn.Parameter], int],
    dp: int,
    capacity: int,
    shards_per_node: int = 1,
    initial_loads: Optional[List[int]] = None,
) -> Optional[Dict[torch.nn.Parameter, int]]:
    """Place params larger than a shard first, from shard 0 on (they straddle: each over as
    few shards as its size allows, inside one node where it fits in one), then the rest
    whole: largest cost first, to the least-loaded shard with room. None if one does not
    fit."""
    placement: Dict[torch.nn.Parameter, int] = {}
    used = [0] * dp
    loads = list(initial_loads) if initial_loads is not None else [0] * dp
    cursor = 0
    order = {p: i for i, p in enumerate(params)}
    for param in (p for p in params if p.numel() > capacity):
        cursor = _straddle_start(pad_param_start(cursor), param.numel(), capacity, shards_per_node)
        placement[param] = cursor
        first, last = cursor // capacity, (cursor + param.numel() - 1) // capacity
        if last >= dp:
            return None
        # The owner is one of its holders; count its cost where most of it lies.
        middle = (cursor + param.numel() // 2) // capacity
        loads[middle] += cost(param)
        cursor += param.numel()
        for s in range(first, last + 1):
            used[s] = max(used[s], min(capacity, cursor - s * capacity))
    for param in sorted((p for p in params if p.numel() <= capacity), key=lambda p: (-cost(p), -p.numel(), order[p])):
        room = [s for s in range(dp) if pad_param_start(used[s]) + param.numel() <= capacity]
        if not room:
            return None
        s = min(room, key=lambda r: (loads[r], used[r], r))
        offset = pad_param_start(used[s])
        placement[param] = s * capacity + offset
        used[s] = offset + param.numel()
        loads[s] += cost(param)
    return placement


def _straddle_start(cursor: int, numel: int, capacity: int, shards_per_node: int) -> int:
    """The first start at or after ``cursor`` where ``numel`` elements cross no more shards
    than they must, and no node boundary if they fit in one node (the gap left behind
    is filled with whole params later)."""
    need = -(-numel // capacity)
    first, last = cursor // capacity, (cursor + numel - 1) // capacity
    if last - first + 1 > need:
        cursor = (first + 1) * capacity
        first, last = first + 1, first + need
    if shards_per_node > 1 and need <= shards_per_node and first // shards_per_node != last // shards_per_node:
        cursor = (last // shards_per_node) * shards_per_node * capacity
    return cursor


def is_owner_aligned(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether every DDP chunk was built with :func:`owner_aligned_param_layout`."""
    return all(isinstance(getattr(c, "full_param_layout", None), OwnerAlignedParamLayout) for c in model_chunks)


def prefetch_param_gathers_in_forward_order(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Chain each DDP chunk's bucket groups for ``overlap_param_gather`` in the order the
    forward first uses them, so each group's all-gather is started by the group before it.

    DDP's forward pre-hook waits for a bucket group's all-gather, then starts the one of the
    group it names next (``next_param_gather_bucket_group``). DDP names them in its
    ``bucket_groups`` list order reversed, which is the forward's order while there is one
    buffer. Our layout puts Muon matrices and the other parameters in buffers of their own,
    which the forward uses interleaved: by list order the Muon buffer's first group would
    be started only when the forward reaches it (its all-gather waited for, not overlapped),
    and its last group would name the other buffer's first one, started long before (the
    warning "The next bucket's parameter all-gather operation has already been
    dispatched"). Ordered by each group's first parameter in registration order, the chain
    follows the forward again. Dense and expert groups stay separate chains, as DDP keeps
    them. The same all-gathers, the same bits: only when each starts changes."""
    for chunk in model_chunks:
        if not getattr(chunk.ddp_config, "overlap_param_gather", False):
            continue
        first_use: Dict[int, int] = {}
        for index, param in enumerate(chunk.module.parameters()):
            group = chunk.param_to_bucket_group.get(param)
            if group is not None:
                first_use.setdefault(id(group), index)
        for groups in (chunk.bucket_groups, chunk.expert_parallel_bucket_groups):
            ordered = sorted(groups, key=lambda g: first_use.get(id(g), math.inf))
            for group, following in zip(ordered, [*ordered[1:], None]):
                group.next_param_gather_bucket_group = following
