"""The process groups Muon uses, resolved and created in one place.

* :func:`parallel_groups`: the tensor-, data-, context-, expert- and pipeline-parallel
  groups of this rank, from a ``ProcessGroupCollection`` or Megatron's ``parallel_state``
  (what the buffer layout, the optimizer and QK-Clip read).
* :func:`build_ortho_group`: the *orthogonalization group*, the tensor-parallel x
  data-parallel ranks that hold pieces of the same weights, with a (tp, dp) coordinate per
  member. Megatron-core has such a group for dense weights (``tp_dp_cp``) but not for every
  combination the optimizer needs (expert TP x expert DP, the intra-instance DP group), so
  it is built from the two groups it is made of.
* :func:`subgroup`: the group of a few of its ranks that orthogonalize one matrix together
  (multi-rank Newton–Schulz).
* :func:`gpus_per_node`: how many consecutive global ranks share a node.

Groups are created once per process and cached by their global ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class OrthoGroup:
    """A process group with each member's (tp, dp) coordinate."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    coords: List[Tuple[int, int]]
    """coords[group_rank] = (tp_rank, dp_rank)."""
    tp_size: int
    dp_size: int
    nodes: Tuple[int, ...] = ()
    """nodes[group_rank] = the node it runs on (all on node 0 if empty)."""

    def node_of(self, rank: int) -> int:
        return self.nodes[rank] if self.nodes else 0

    def rank_of(self, tp: int, dp: int) -> int:
        return self._rank_of[(tp, dp)]

    def __post_init__(self) -> None:
        self._rank_of = {c: r for r, c in enumerate(self.coords)}


_GROUPS: Dict[Tuple[str, Tuple[int, ...]], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's Megatron process groups that Muon reads (Megatron's names)."""

    tp: dist.ProcessGroup
    expt_tp: dist.ProcessGroup
    intra_dp_cp: dist.ProcessGroup
    """The distributed optimizer's data-parallel group (x context parallel) of dense params."""
    intra_expt_dp: dist.ProcessGroup
    """The distributed optimizer's data-parallel group of expert-parallel params."""
    pp_rank: int
    cp_size: int
    ep_size: int


def parallel_groups(pg_collection=None) -> ParallelGroups:
    """This rank's groups from ``pg_collection``, else from Megatron's ``parallel_state``."""
    if pg_collection is not None:
        tp = pg_collection.tp
        cp = getattr(pg_collection, "cp", None)
        ep = getattr(pg_collection, "ep", None)
        return ParallelGroups(
            tp=tp,
            expt_tp=getattr(pg_collection, "expt_tp", None) or tp,
            intra_dp_cp=pg_collection.intra_dp_cp,
            intra_expt_dp=pg_collection.intra_expt_dp,
            pp_rank=pg_collection.pp.rank(),
            cp_size=cp.size() if cp is not None else 1,
            ep_size=ep.size() if ep is not None else 1,
        )
    from megatron.core import parallel_state as ps

    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        expt_tp=ps.get_expert_tensor_parallel_group(),
        intra_dp_cp=ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
        intra_expt_dp=ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(),
    )


def gpus_per_node() -> int:
    """Consecutive global ranks on one node: torchrun's ``LOCAL_WORLD_SIZE``, else the
    visible GPUs, else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or torch.cuda.device_count() or 1


def _cached_group(kind: str, ranks: Tuple[int, ...], **kwargs) -> dist.ProcessGroup:
    if (kind, ranks) not in _GROUPS:
        _GROUPS[(kind, ranks)] = dist.new_group(list(ranks), **kwargs)
    return _GROUPS[(kind, ranks)]


def _coords(tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup) -> Dict[int, Tuple[int, int]]:
    """Global rank -> (tp_rank, dp_rank) for every member of the TP x DP group of this rank."""
    tp_ranks = dist.get_process_group_ranks(tp_group)
    gathered = [None] * dp_group.size()
    dist.all_gather_object(gathered, tp_ranks, group=dp_group)
    return {g: (t, r) for r, ranks in enumerate(gathered) for t, g in enumerate(ranks)}


def _every_ortho_group(members: Tuple[int, ...]) -> List[Tuple[int, ...]]:
    """Every rank's orthogonalization group, in the order of their lowest ranks, given this
    rank's ``members`` (collective over the default group).

    ``new_group`` needs every group's ranks on every rank, so each rank learns the world's
    partition: an all-gather of two integers per rank (its group's lowest rank and size),
    not of its members, so each rank holds O(world) integers, as every ``new_group`` call
    for every group must anyway (the members of all groups would be world x group size).
    The groups partition the world, so sorting them by lowest rank orders them as sorting
    their member tuples does. Groups that do not partition the world (TP groups of a DP
    group's ranks that other ranks combine differently) are refused."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (members[0], len(members)))
    groups: Dict[int, List[int]] = {}
    for rank, (lowest, _) in enumerate(everyone):
        groups.setdefault(lowest, []).append(rank)
    if any(len(groups[lowest]) != size for lowest, size in everyone) or tuple(groups[members[0]]) != members:
        raise RuntimeError(
            "The tensor-parallel x data-parallel groups of the ranks do not partition the world into "
            "orthogonalization groups (each rank's group must be the same set on all of its members): "
            "pass every rank the tensor- and data-parallel groups of one Megatron parallel layout."
        )
    return [tuple(groups[lowest]) for lowest in sorted(groups)]


def build_ortho_group(tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup) -> OrthoGroup:
    """The orthogonalization group of this rank (collective over the default group: every
    rank takes part in creating every group, in the same order, as ``new_group`` requires)."""
    coords = _coords(tp_group, dp_group)
    members = tuple(sorted(coords))
    if tp_group.size() == 1:
        group = dp_group
    elif dp_group.size() == 1:
        group = tp_group
    else:
        for ranks in _every_ortho_group(members):
            _cached_group("ortho", ranks)
        group = _GROUPS[("ortho", members)]
    ordered = [None] * len(members)
    for global_rank, coord in coords.items():
        ordered[dist.get_group_rank(group, global_rank)] = coord
    ranks = dist.get_process_group_ranks(group)
    per_node = gpus_per_node()
    return OrthoGroup(
        group=group,
        rank=group.rank(),
        size=group.size(),
        coords=ordered,
        tp_size=tp_group.size(),
        dp_size=dp_group.size(),
        nodes=tuple(r // per_node for r in ranks),
    )


def subgroup(group: OrthoGroup, members: Tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of the ``members`` (group ranks) of ``group``. Only members call
    this, so the group is made with ``use_local_synchronization``; its name is a hash of
    the ranks, so it must be created once per process (a second creation would reuse the
    name and hang): cached."""
    global_ranks = dist.get_process_group_ranks(group.group)
    ranks = tuple(sorted(global_ranks[r] for r in members))
    return _cached_group("subgroup", ranks, use_local_synchronization=True)


def current_device() -> Optional[torch.device]:
    """The device this rank computes on (its CUDA device, else the CPU)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
