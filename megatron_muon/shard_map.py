"""The shard map: which range of every parameter each data-parallel rank holds, and this
rank's fp32 master of it. Built once per optimizer by its storage backend (``storage/``).

Megatron's distributed optimizer cuts every DDP bucket into ``dp_size`` equal contiguous
shards and gives DP rank ``r`` the ``r``-th; a parameter's elements in that shard are the
rank's range of it (``DistributedOptimizer._build_model_gbuf_param_range_map``). Megatron
evaluates that rule for its own rank only; Muon needs it for every rank (the planner must
know where every piece of every matrix lives), so :func:`dp_ranges_in_layout` evaluates
Megatron's own function for each rank, on a live DDP buffer or on a layout computed
without one (both carry ``param_index_map`` and ``bucket_indices``).

:class:`ShardMap` holds, per parameter of one optimizer: each DP rank's range of its flat
(tensor-parallel-local) storage, this rank's range, and this rank's fp32 master of that
range (Megatron's ``shard_fp32_from_float16_groups`` / ``shard_fp32_groups`` tensor, 1-D).
The planner, the step, QK-Clip, checkpoints and the CPU offload read it. Each storage
backend builds it from its engine's buffers: Megatron's DDP buffers under its
``DistributedOptimizer`` (with :func:`dp_ranges_in_layout`), Megatron-FSDP's (whose shards
follow the same rule, from its own shard function).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

FlatRange = Tuple[int, int]
"""(start, end) in a parameter's flat storage; ``(0, 0)`` where a rank holds none of it."""


def dp_ranges_in_layout(layout, param: torch.Tensor, dp_size: int) -> List[FlatRange]:
    """Each DP rank's range of ``param`` under ``layout`` (a DDP buffer or a per-buffer
    layout: anything with ``param_index_map`` and ``bucket_indices``)."""
    start, end, bucket_id = layout.param_index_map[param]
    b_start, b_end = layout.bucket_indices[bucket_id]
    per_rank = (b_end - b_start) // dp_size
    ranges = []
    for r in range(dp_size):
        world = Range(b_start + r * per_rank, b_start + (r + 1) * per_rank)
        held = DistributedOptimizer._build_model_gbuf_param_range_map({param: (start, end, bucket_id)}, world, b_start)
        rng = held[param]["param"] if param in held else None
        ranges.append((rng.start, rng.end) if rng is not None and rng.end > rng.start else (0, 0))
    return ranges


@dataclass(frozen=True)
class ParamShard:
    """One parameter as the optimizer of this rank sees it."""

    param: torch.nn.Parameter
    dp_ranges: Tuple[FlatRange, ...]
    """Each DP rank's range of the parameter's flat (TP-local) storage."""
    dp_rank: int
    master: Optional[torch.Tensor]
    """This rank's fp32 master of ``dp_ranges[dp_rank]`` (1-D), None where it holds none."""

    @property
    def start(self) -> int:
        return self.dp_ranges[self.dp_rank][0]

    @property
    def end(self) -> int:
        return self.dp_ranges[self.dp_rank][1]


class ShardMap:
    """Every parameter of one optimizer's buffers -> its :class:`ParamShard`."""

    def __init__(self, shards: Sequence[ParamShard]) -> None:
        self._shards = {id(s.param): s for s in shards}
        self.params = [s.param for s in shards]
        """The parameters, in buffer order (the same on every rank of a group)."""

    def __getitem__(self, param: torch.nn.Parameter) -> ParamShard:
        return self._shards[id(param)]

    def __contains__(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._shards

    def __iter__(self) -> Iterator[ParamShard]:
        return (self._shards[id(p)] for p in self.params)

    def master(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's fp32 master of ``param`` (None where it holds none, or not ours)."""
        shard = self._shards.get(id(param))
        return shard.master if shard is not None else None
