"""Orthogonalization groups: the tensor-parallel x data-parallel ranks that share parameters.

A dense weight is cut along its partition dim over the TP ranks, and each TP slice is cut
into byte ranges over the distributed optimizer's DP ranks. The ranks holding pieces of
the same weights form one group, with a (tp, dp) coordinate per member. Megatron-core has
such a group for dense weights (``tp_dp_cp``) but not for every combination the
optimizer needs (expert TP x expert DP, the intra-instance DP group), so we build it
from the two groups it is made of; every rank takes part in creating every group, in the
same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch.distributed as dist

from .planner import OrthoGroup

_GROUPS: Dict[Tuple[int, ...], dist.ProcessGroup] = {}


def _coords(tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup) -> Dict[int, Tuple[int, int]]:
    """Global rank -> (tp_rank, dp_rank) for every member of the TP x DP group of this rank."""
    tp_ranks = dist.get_process_group_ranks(tp_group)
    gathered = [None] * dp_group.size()
    dist.all_gather_object(gathered, tp_ranks, group=dp_group)
    return {g: (t, r) for r, ranks in enumerate(gathered) for t, g in enumerate(ranks)}


def build_ortho_group(tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup) -> OrthoGroup:
    """The orthogonalization group of this rank (collective over the default group)."""
    coords = _coords(tp_group, dp_group)
    members = tuple(sorted(coords))
    if tp_group.size() == 1:
        group = dp_group
    elif dp_group.size() == 1:
        group = tp_group
    else:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, members)
        for ranks in sorted(set(everyone)):
            if ranks not in _GROUPS:
                _GROUPS[ranks] = dist.new_group(list(ranks))
        group = _GROUPS[members]
    ordered = [None] * len(members)
    for global_rank, coord in coords.items():
        ordered[dist.get_group_rank(group, global_rank)] = coord
    return OrthoGroup(
        group=group,
        rank=group.rank(),
        size=group.size(),
        coords=ordered,
        tp_size=tp_group.size(),
        dp_size=dp_group.size(),
    )
