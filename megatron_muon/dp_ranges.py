"""Which flat range of every parameter each data-parallel rank holds: the one definition.

Megatron's distributed optimizer cuts every DDP bucket into ``dp_size`` equal contiguous
shards and gives DP rank ``r`` the ``r``-th; a parameter's elements in that shard are the
rank's range of it (Megatron's ``DistributedOptimizer._build_model_gbuf_param_range_map``).
Megatron evaluates that rule for its own rank only; the Muon planner needs it for every
rank, so every rank knows where every piece of every matrix lives. The functions here
evaluate Megatron's rule for every rank, on a live DDP buffer (``_ParamAndGradBuffer``) or
on a layout computed without one (Megatron's ``_compute_per_buffer_param_layout``, our
``buffer_layout``): both carry ``param_index_map`` and ``bucket_indices``. The optimizer,
the shape-only plans (``synthetic.py``) and the benchmarks all call them.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

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


def dp_shard_ranges(buffer) -> Dict[torch.nn.Parameter, List[FlatRange]]:
    """For every param of a live DDP buffer, the range of it that each rank of the buffer's
    data-parallel group holds."""
    size = buffer.data_parallel_group.size()
    return {param: dp_ranges_in_layout(buffer, param, size) for param in buffer.param_index_map}


def holder_dp_rank(layout, param: torch.Tensor, dp_size: int) -> int:
    """The DP rank holding the first element of ``param`` (the only one where the layout
    keeps the param whole in one shard, as Megatron's layer-wise layout does)."""
    return next(r for r, (s, e) in enumerate(dp_ranges_in_layout(layout, param, dp_size)) if e > s)
