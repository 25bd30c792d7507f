"""Ownership plan: which rank orthogonalizes which logical matrix, and who sends it what.

The ranks that hold pieces of a parameter form its *orthogonalization group*: the
tensor-parallel ranks (each holds a TP slice) times the data-parallel ranks of the
distributed optimizer (each holds a contiguous range of every flattened TP slice). Every
logical matrix becomes a ``Job`` owned by exactly one rank of that group. The owner
receives the matrix's pieces (``sources``), runs Newton–Schulz, and sends each piece of
the update back to the rank that holds it (``dests``).

Owners are assigned in two passes, largest Newton–Schulz cost first within each chunk.
First every job goes to the rank that already holds most of the matrix (whose own pieces
then never cross the wire) as long as that rank stays at or under the mean load; then the
rest go to the least-loaded rank (Graham's list scheduling). Every rank's load ends within
one matrix's cost of every other rank's. Jobs are cut into chunks of
about ``muon_chunk_numel`` elements so that the pipeline can overlap one chunk's
communication with another's compute. Everything here is computed once, from the local
model structure (which is identical on every rank of a group), and cached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .matrices import Block, LogicalMatrix, MuonParam
from .newton_schulz import newton_schulz_flops
from .split_newton_schulz import SplitCost, place_split_jobs


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one logical matrix piece, held by the rank at (tp, dp).

    ``start:end`` is the range in TP rank ``tp``'s flat parameter storage (the same
    coordinates on every DP rank); ``piece_offset`` is where it lands in that TP rank's
    piece of the matrix, flattened.
    """

    tp: int
    dp: int
    start: int
    end: int
    piece_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Job:
    """Orthogonalize one logical matrix on one rank."""

    index: int
    param_index: int
    matrix: LogicalMatrix
    sources: List[Segment]
    dests: List[Segment]
    owner_tp: Optional[int]
    """Owners are restricted to this TP coordinate (blockwise / duplicated modes)."""
    flops: int
    owner: int = -1
    """Rank in the orthogonalization group."""
    split: Tuple[int, ...] = ()
    """Group ranks that orthogonalize this matrix together, owner first (split
    Newton–Schulz, ``megatron_muon.split_newton_schulz``); empty: the owner alone."""

    @property
    def numel(self) -> int:
        rows, cols = self.matrix.shape
        return rows * cols

    def held_elements(self, group: "OrthoGroup") -> Dict[int, int]:
        """Elements of the matrix (pieces read plus pieces written) each group rank holds."""
        held: Dict[int, int] = {}
        for seg in self.sources + self.dests:
            r = group.rank_of(seg.tp, seg.dp)
            held[r] = held.get(r, 0) + seg.numel
        return held


@dataclass
class Chunk:
    index: int
    jobs: List[Job]


@dataclass
class OrthoGroup:
    """A process group with each member's (tp, dp) coordinate."""

    group: Optional[torch.distributed.ProcessGroup]
    rank: int
    size: int
    coords: List[Tuple[int, int]]
    """coords[group_rank] = (tp_rank, dp_rank)."""
    tp_size: int
    dp_size: int

    def rank_of(self, tp: int, dp: int) -> int:
        return self._rank_of[(tp, dp)]

    def __post_init__(self) -> None:
        self._rank_of = {c: r for r, c in enumerate(self.coords)}


@dataclass
class Plan:
    """The complete, rank-independent ownership plan of one orthogonalization group."""

    params: List[MuonParam]
    jobs: List[Job]
    chunks: List[Chunk]
    group: OrthoGroup
    loads: List[int] = field(default_factory=list)

    def jobs_owned_by(self, rank: int) -> List[Job]:
        return [j for j in self.jobs if j.owner == rank]

    def fingerprint(self) -> str:
        """A hash of everything that must agree across the ranks of the group."""
        h = hashlib.sha256()
        for job in self.jobs:
            h.update(f"{job.matrix.name}|{job.matrix.shape}|{job.owner}|{job.split}|".encode())
            for s in job.sources + job.dests:
                h.update(f"{s.tp},{s.dp},{s.start},{s.end},{s.piece_offset};".encode())
        return h.hexdigest()


def segments(matrix: LogicalMatrix, dp_ranges: Sequence[Tuple[int, int]], tps: Sequence[int]) -> List[Segment]:
    """Cut the pieces of ``matrix`` on TP ranks ``tps`` at the data-parallel shard bounds."""
    out = []
    for tp, blocks in matrix.pieces:
        if tp not in tps:
            continue
        piece_offset = 0
        for block in blocks:
            b_start, b_end = block.offset, block.offset + block.numel
            for dp, (lo, hi) in enumerate(dp_ranges):
                start, end = max(b_start, lo), min(b_end, hi)
                if end > start:
                    out.append(Segment(tp, dp, start, end, piece_offset + start - b_start))
            piece_offset += block.numel
    return out


def make_jobs(
    params: Sequence[MuonParam],
    dp_ranges: Dict[int, Sequence[Tuple[int, int]]],
    tp_size: int,
    tp_mode: str,
    ns_steps: int,
    ns_method: str = "standard",
) -> List[Job]:
    """One job per logical matrix (exact), per TP piece (blockwise) or per TP rank that
    needs the whole matrix (duplicated). ``flops`` counts the iteration ``ns_method``
    runs on the job's shape."""
    jobs: List[Job] = []
    all_tps = list(range(tp_size))

    def add(param_index: int, matrix: LogicalMatrix, src_tps, dst_tps, owner_tp):
        ranges = dp_ranges[param_index]
        rows, cols = matrix.ns_shape
        jobs.append(
            Job(
                index=len(jobs),
                param_index=param_index,
                matrix=matrix,
                sources=segments(matrix, ranges, src_tps),
                dests=segments(matrix, ranges, dst_tps),
                owner_tp=owner_tp,
                flops=newton_schulz_flops(rows, cols, ns_steps, batch=matrix.column_groups, method=ns_method),
            )
        )

    restrict = tp_mode != "exact"
    for param_index, mp in enumerate(params):
        for matrix in mp.matrices:
            held = [t for t, _ in matrix.pieces]
            if matrix.replicated:
                # Identical on every TP rank: read rank 0's copy, write every copy.
                add(param_index, matrix, [0], all_tps, None)
            elif len(held) == 1:
                add(param_index, matrix, held, held, held[0] if restrict else None)
            elif tp_mode == "blockwise":
                for piece in matrix.blockwise():
                    t = piece.pieces[0][0]
                    add(param_index, piece, [t], [t], t)
            elif tp_mode == "duplicated":
                for t in held:
                    add(param_index, matrix, held, [t], t)
            else:
                add(param_index, matrix, held, held, None)
    return jobs


def assign_owners(
    jobs: List[Job],
    group: OrthoGroup,
    chunk_numel: int,
    holders_only: bool = False,
    loads: Optional[List[int]] = None,
) -> Tuple[List[Chunk], List[int]]:
    """Cut jobs into chunks and give every job an owner (balanced by NS cost, local where free).
    Jobs that already have an owner (split jobs) keep it; ``loads`` is their load per rank.

    ``holders_only`` (owner-aligned buffers): a job may only go to a rank at a DP index that
    holds some of its matrix, so no piece crosses DP unless the matrix itself straddles DP
    shards; balance across DP indices is then the buffer layout's job."""
    chunks: List[Chunk] = []
    current: List[Job] = []
    size = 0
    for job in jobs:
        if current and size + job.numel > chunk_numel:
            chunks.append(Chunk(len(chunks), current))
            current, size = [], 0
        current.append(job)
        size += job.numel
    if current:
        chunks.append(Chunk(len(chunks), current))

    loads = list(loads) if loads is not None else [0] * group.size

    def may_own(job: Job, r: int) -> bool:
        tp, dp = group.coords[r]
        if job.owner_tp is not None and tp != job.owner_tp:
            return False
        return not holders_only or any(seg.dp == dp for seg in job.sources + job.dests)

    allowed = {job.index: [r for r in range(group.size) if may_own(job, r)] for job in jobs}
    order = [
        job for chunk in chunks for job in sorted(chunk.jobs, key=lambda j: (-j.flops, j.index)) if job.owner < 0
    ]
    # 1. Local first: a job goes to the allowed rank holding most of it while that rank stays
    #    at or under the mean load.
    mean = (sum(loads) + sum(job.flops for job in order)) / max(group.size, 1)
    for job in order:
        held = job.held_elements(group)
        holder = min(allowed[job.index], key=lambda r: (-held.get(r, 0), loads[r], r))
        if held.get(holder, 0) > 0 and loads[holder] + job.flops <= mean:
            job.owner = holder
            loads[holder] += job.flops
    # 2. The rest by list scheduling: the least-loaded allowed rank. A rank that ends highest
    #    either took its last job here as the least loaded, or stayed at or under the mean:
    #    both keep every rank within one job's cost of every other.
    for job in order:
        if job.owner < 0:
            job.owner = min(allowed[job.index], key=lambda r: (loads[r], r))
            loads[job.owner] += job.flops
    return chunks, loads


def build_plan(
    params: Sequence[MuonParam],
    dp_ranges: Dict[int, Sequence[Tuple[int, int]]],
    group: OrthoGroup,
    tp_mode: str,
    ns_steps: int,
    chunk_numel: int,
    holders_only: bool = False,
    ns_method: str = "standard",
    split_max_ranks: int = 1,
    split_cost: Optional[SplitCost] = None,
) -> Plan:
    """The ownership plan for ``params`` (identical on every rank of ``group``).

    Matrices that alone exceed a rank's mean load may be split over up to
    ``split_max_ranks`` ranks (``split_newton_schulz.place_split_jobs``) before the rest
    are assigned. Split NS trades FLOPs for blocking all-reduces, so the plan is built three
    ways (no split; splits chosen by FLOPs alone; splits priced by ``split_cost``, the
    all-reduce bytes at their link class) and the one whose busiest rank has the fewest
    FLOPs plus FLOP-equivalent split bytes (:meth:`SplitCost.rank_flops`) wins (ties: fewer
    splits). ``holders_only``: see :func:`assign_owners`."""
    split_cost = split_cost or SplitCost()
    free = SplitCost(0.0, 0.0, split_cost.node_of)
    candidates = [1] if split_max_ranks < 2 else [1, free, split_cost]
    best: Optional[Tuple[float, Plan]] = None
    for candidate in candidates:
        jobs = make_jobs(params, dp_ranges, group.tp_size, tp_mode, ns_steps, ns_method)
        max_ranks = 1 if candidate == 1 else split_max_ranks
        loads = place_split_jobs(jobs, group, max_ranks, ns_steps, holders_only, None if candidate == 1 else candidate)
        chunks, loads = assign_owners(jobs, group, chunk_numel, holders_only, loads)
        bound = max(split_cost.rank_flops(jobs, loads, ns_steps), default=0.0)
        if best is None or bound < best[0]:
            best = (bound, Plan(params=list(params), jobs=jobs, chunks=chunks, group=group, loads=loads))
    return best[1]


def plan_statistics(plan: Plan) -> Dict[str, object]:
    """Per-rank matrix counts and Newton–Schulz FLOPs, for logs, tests and the scale model."""
    counts = [0] * plan.group.size
    for job in plan.jobs:
        counts[job.owner] += 1
    return {
        "matrices": len(plan.jobs),
        "chunks": len(plan.chunks),
        "matrices_per_rank": counts,
        "ns_flops_per_rank": list(plan.loads),
        "max_job_flops": max((j.flops for j in plan.jobs), default=0),
        "split_jobs": {j.matrix.name: len(j.split) for j in plan.jobs if j.split},
    }


def block_of(matrix: LogicalMatrix, tp: int) -> Tuple[Block, ...]:
    for t, blocks in matrix.pieces:
        if t == tp:
            return blocks
    raise KeyError(f"{matrix.name} has no piece on TP rank {tp}")
