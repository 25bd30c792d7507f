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
model structure (which is identical on every rank of a group), and cached. Its time is
near-linear in what the plan holds: a block finds the DP ranges it overlaps by bisection
(:class:`DpBounds`), the jobs are cut once for the candidate plans :func:`build_plan`
compares, and the least-loaded rank comes from a heap (DeepSeek-V3's dense plan at DP 1,024:
0.2 s, where a scan of every rank per block and per job took 25 s; docs/benchmarks.md
section 4).

:func:`rank_messages` turns the plan into what one rank sends and receives in each chunk
(:class:`ChunkMessages`), also once: the step only packs and unpacks by these lists.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .matrices import LogicalMatrix, MuonParam
from .multirank_newton_schulz import MultirankCost, place_multirank_jobs
from .newton_schulz import newton_schulz_flops
from .process_groups import OrthoGroup


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
    ns_ranks: Tuple[int, ...] = ()
    """Group ranks that orthogonalize this matrix together, owner first (multi-rank
    Newton–Schulz, ``megatron_muon.multirank_newton_schulz``); empty: the owner alone."""

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
class Plan:
    """The complete, rank-independent ownership plan of one orthogonalization group."""

    params: List[MuonParam]
    jobs: List[Job]
    chunks: List[Chunk]
    group: OrthoGroup
    loads: List[int] = field(default_factory=list)

    def fingerprint(self) -> str:
        """A hash of everything that must agree across the ranks of the group."""
        h = hashlib.sha256()
        for job in self.jobs:
            h.update(f"{job.matrix.name}|{job.matrix.shape}|{job.owner}|{job.ns_ranks}|".encode())
            for s in job.sources + job.dests:
                h.update(f"{s.tp},{s.dp},{s.start},{s.end},{s.piece_offset};".encode())
        return h.hexdigest()


class DpBounds:
    """Each DP rank's range of one parameter, sorted by start for bisection: a block finds
    the ranges it overlaps in ``log(DP)`` steps plus one per overlap, not by a scan of every
    rank (``dp_ranges``: as ``ParamShard.dp_ranges``; ranks that hold none are skipped).
    Ranges that overlap each other (no layout makes them) are scanned."""

    def __init__(self, dp_ranges: Sequence[Tuple[int, int]]) -> None:
        self.dp_ranges = dp_ranges
        self.held = sorted((lo, hi, dp) for dp, (lo, hi) in enumerate(dp_ranges) if hi > lo)
        self.disjoint = all(a[1] <= b[0] for a, b in zip(self.held, self.held[1:]))
        self.ends = [hi for _, hi, _ in self.held]

    def overlaps(self, start: int, end: int) -> List[Tuple[int, int, int]]:
        """``(dp, lo, hi)`` of every DP rank's part of ``[start, end)``, in DP order."""
        if not self.disjoint:
            cuts = ((dp, max(start, lo), min(end, hi)) for dp, (lo, hi) in enumerate(self.dp_ranges))
            return [cut for cut in cuts if cut[2] > cut[1]]
        out = []
        for i in range(bisect.bisect_right(self.ends, start), len(self.held)):
            lo, hi, dp = self.held[i]
            if lo >= end:
                break
            if min(end, hi) > max(start, lo):
                out.append((dp, max(start, lo), min(end, hi)))
        return sorted(out)


def segments(
    matrix: LogicalMatrix,
    dp_ranges: Sequence[Tuple[int, int]],
    tps: Sequence[int],
    bounds: Optional[DpBounds] = None,
) -> List[Segment]:
    """Cut the pieces of ``matrix`` on TP ranks ``tps`` at the data-parallel shard bounds
    (``bounds``: ``DpBounds(dp_ranges)``, built once per parameter by :func:`make_jobs`)."""
    bounds = bounds or DpBounds(dp_ranges)
    out = []
    for tp, blocks in matrix.pieces:
        if tp not in tps:
            continue
        piece_offset = 0
        for block in blocks:
            b_start, b_end = block.offset, block.offset + block.numel
            for dp, start, end in bounds.overlaps(b_start, b_end):
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
    bounds: Dict[int, DpBounds] = {}

    def add(param_index: int, matrix: LogicalMatrix, src_tps, dst_tps, owner_tp):
        ranges = dp_ranges[param_index]
        if param_index not in bounds:
            bounds[param_index] = DpBounds(ranges)
        rows, cols = matrix.ns_shape
        jobs.append(
            Job(
                index=len(jobs),
                param_index=param_index,
                matrix=matrix,
                sources=segments(matrix, ranges, src_tps, bounds[param_index]),
                dests=segments(matrix, ranges, dst_tps, bounds[param_index]),
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
    owner_aligned: bool = False,
    loads: Optional[List[int]] = None,
) -> Tuple[List[Chunk], List[int]]:
    """Cut jobs into chunks and give every job an owner (balanced by NS cost, local where free).
    Jobs that already have an owner (multi-rank jobs) keep it; ``loads`` is their load per rank.

    ``owner_aligned`` (owner-aligned buffers): a job may only go to a rank at a DP index that
    holds some of its matrix, so no piece crosses DP unless the matrix itself straddles DP
    shards; balance across DP indices is then the buffer layout's job."""
    chunks = cut_chunks(jobs, chunk_numel)
    loads = list(loads) if loads is not None else [0] * group.size
    order = [job for chunk in chunks for job in sorted(chunk.jobs, key=lambda j: (-j.flops, j.index)) if job.owner < 0]
    # 1. Local first: a job goes to the allowed rank holding most of it while that rank stays
    #    at or under the mean load. (Only ranks that hold some of it can qualify.)
    mean = (sum(loads) + sum(job.flops for job in order)) / max(group.size, 1)
    for job in order:
        held = job.held_elements(group)
        holders = [r for r in held if job.owner_tp is None or group.coords[r][0] == job.owner_tp]
        if holders:
            holder = min(holders, key=lambda r: (-held[r], loads[r], r))
            if loads[holder] + job.flops <= mean:
                job.owner = holder
                loads[holder] += job.flops
    # 2. The rest by list scheduling: the least-loaded allowed rank. A rank that ends highest
    #    either took its last job here as the least loaded, or stayed at or under the mean:
    #    both keep every rank within one job's cost of every other.
    least = _LeastLoaded(group, loads)
    for job in order:
        if job.owner < 0:
            if owner_aligned:
                # The ranks at the DP indices that hold some of the matrix.
                dps = {seg.dp for seg in job.sources + job.dests}
                tps = range(group.tp_size) if job.owner_tp is None else [job.owner_tp]
                allowed = [group.rank_of(tp, dp) for dp in dps for tp in tps]
                job.owner = min(allowed, key=lambda r: (loads[r], r))
            else:
                job.owner = least.rank(job.owner_tp)
            least.add(job.owner, job.flops)
    return chunks, loads


class _LeastLoaded:
    """The least-loaded rank of a group (lowest rank on ties), of all ranks or of one TP
    coordinate's, in ``log(ranks)`` per question: a heap of (load, rank) per such set whose
    entries go stale as ``loads`` grows and are dropped when they reach the top."""

    def __init__(self, group: OrthoGroup, loads: List[int]) -> None:
        self.group, self.loads = group, loads
        self.heaps: Dict[Optional[int], List[Tuple[int, int]]] = {}

    def rank(self, tp: Optional[int]) -> int:
        if tp not in self.heaps:
            members = (r for r, c in enumerate(self.group.coords) if tp is None or c[0] == tp)
            self.heaps[tp] = [(self.loads[r], r) for r in members]
            heapq.heapify(self.heaps[tp])
        heap = self.heaps[tp]
        while heap[0][0] != self.loads[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][1]

    def add(self, rank: int, flops: int) -> None:
        self.loads[rank] += flops
        for tp, heap in self.heaps.items():
            if tp is None or self.group.coords[rank][0] == tp:
                heapq.heappush(heap, (self.loads[rank], rank))


def cut_chunks(jobs: List[Job], chunk_numel: int) -> List[Chunk]:
    """The jobs in model order, cut into chunks of about ``chunk_numel`` elements."""
    chunks: List[Chunk] = []
    current: List[Job] = []
    size = 0
    for job in jobs:
        if current and size + job.numel > chunk_numel:
            chunks.append(Chunk(len(chunks), _by_shape(current)))
            current, size = [], 0
        current.append(job)
        size += job.numel
    if current:
        chunks.append(Chunk(len(chunks), _by_shape(current)))
    return chunks


def _by_shape(jobs: List[Job]) -> List[Job]:
    """A chunk's jobs with the matrices of one shape next to each other (multi-rank ones
    last), otherwise in model order: where each matrix is whole on one rank, the pieces of
    one shape then travel, arrive and leave as one contiguous stack (``Stack``)."""
    return sorted(jobs, key=lambda job: (job.matrix.ns_shape, bool(job.ns_ranks)))


def build_plan(
    params: Sequence[MuonParam],
    dp_ranges: Dict[int, Sequence[Tuple[int, int]]],
    group: OrthoGroup,
    tp_mode: str,
    ns_steps: int,
    chunk_numel: int,
    owner_aligned: bool = False,
    ns_method: str = "standard",
    ns_max_ranks: int = 1,
    cost: Optional[MultirankCost] = None,
) -> Plan:
    """The ownership plan for ``params`` (identical on every rank of ``group``).

    Matrices that alone exceed a rank's mean load may be orthogonalized by up to
    ``ns_max_ranks`` ranks together (``multirank_newton_schulz.place_multirank_jobs``)
    before the rest are assigned. That trades FLOPs for blocking all-reduces, so the plan is
    built three ways (every matrix on one rank; multi-rank jobs chosen by FLOPs alone; and
    priced by ``cost``, the all-reduce bytes at their link class) and the one whose busiest
    rank has the fewest FLOPs plus FLOP-equivalent bytes (:meth:`MultirankCost.rank_flops`)
    wins (ties: fewer multi-rank jobs). ``owner_aligned``: see :func:`assign_owners`."""
    cost = cost or MultirankCost()
    free = MultirankCost(0.0, 0.0)
    candidates = [None] if ns_max_ranks < 2 else [None, free, cost]
    best: Optional[Tuple[float, Plan]] = None
    # The jobs' segments are cut once; each candidate gets fresh jobs (owners, FLOPs) over them.
    unassigned = make_jobs(params, dp_ranges, group.tp_size, tp_mode, ns_steps, ns_method)
    for candidate in candidates:
        jobs = [replace(job) for job in unassigned]
        max_ranks = 1 if candidate is None else ns_max_ranks
        loads = place_multirank_jobs(jobs, group, max_ranks, ns_steps, owner_aligned, candidate)
        chunks, loads = assign_owners(jobs, group, chunk_numel, owner_aligned, loads)
        bound = max(cost.rank_flops(jobs, loads, ns_steps, group), default=0.0)
        if best is None or bound < best[0]:
            best = (bound, Plan(params=list(params), jobs=jobs, chunks=chunks, group=group, loads=loads))
    return best[1]


def plan_for_config(
    config,
    params: Sequence[MuonParam],
    dp_ranges: Dict[int, Sequence[Tuple[int, int]]],
    group: OrthoGroup,
    owner_aligned: bool = False,
    ns_method: Optional[str] = None,
) -> Plan:
    """:func:`build_plan` with every setting from a ``MuonConfig`` (the one way the
    optimizer, the shape-only plans and the scale model build a plan); ``ns_method``: the
    iteration the step runs on its device (``newton_schulz.method_for_device``), default
    the config's."""
    return build_plan(
        params,
        dp_ranges,
        group,
        config.muon_tp_mode,
        config.muon_num_ns_steps,
        config.muon_chunk_numel,
        owner_aligned=owner_aligned,
        ns_method=ns_method or config.muon_ns_method,
        ns_max_ranks=config.muon_ns_max_ranks,
        cost=MultirankCost(config.muon_ns_intra_node_flops_per_byte, config.muon_ns_inter_node_flops_per_byte),
    )


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
        "multirank_jobs": {j.matrix.name: len(j.ns_ranks) for j in plan.jobs if j.ns_ranks},
    }


# ---------------------------------------------------------------------------------------
# Plan -> this rank's messages
# ---------------------------------------------------------------------------------------

Piece = Tuple[int, int, int]
"""(param index, start, end): a range of this rank's fp32 master of a Muon param."""


@dataclass(frozen=True)
class Stack:
    """The owned matrices of one shape in a chunk, orthogonalized as one batched call.

    Where the plan lays the stack out contiguously, no copy is made: ``received`` is the
    range of the gather's receive buffer that *is* the stack (each member's matrix whole,
    one after another), and ``sent`` the range of the scatter's send buffer that the
    scaled updates are written into. None: the matrices are assembled from their pieces
    (several TP ranks, column groups, a matrix cut at DP bounds), or the updates cut into
    them."""

    shape: Tuple[int, int]
    members: Tuple[Tuple[int, int], ...]
    """(owned position, column group) of each matrix of the stack, in stack order."""
    received: Optional[Tuple[int, int]] = None
    sent: Optional[Tuple[int, int]] = None

    @property
    def positions(self) -> frozenset:
        return frozenset(i for i, _ in self.members)


@dataclass
class ChunkMessages:
    """This rank's share of one chunk: what it sends, what arrives, where each piece goes.

    Gather (momentum pieces to the owners) and scatter (update pieces back to the holders)
    each travel as one ``all_to_all_single`` over the orthogonalization group, packed in
    group-rank order; the lists below are in that order."""

    index: int
    jobs: List[Job]
    """Every job of the chunk (multi-rank Newton–Schulz pairs its collectives by them)."""
    owned: List[Job]
    """The jobs this rank orthogonalizes, in chunk order."""
    momentum: List[Piece] = field(default_factory=list)
    """Ranges whose momentum this chunk advances: those it sends first (each range once);
    the first chunk also advances held ranges no chunk sends (a TP-replicated matrix is
    read from TP rank 0's copy only)."""
    kept: List[Piece] = field(default_factory=list)
    """Ranges of ``momentum`` sent again by a later chunk (duplicated TP mode): their
    orthogonalization input is kept until then."""
    gather_send: List[Piece] = field(default_factory=list)
    gather_send_splits: List[int] = field(default_factory=list)
    gather_recv_splits: List[int] = field(default_factory=list)
    gather_place: List[Tuple[int, int, int, int, int]] = field(default_factory=list)
    """(owned position, tp, piece offset, receive offset, numel): where each received
    segment lands in its matrix's TP piece."""
    scatter_send: List[Tuple[int, int, int, int]] = field(default_factory=list)
    """(owned position, tp, piece offset, numel), in destination order."""
    scatter_send_splits: List[int] = field(default_factory=list)
    scatter_recv_splits: List[int] = field(default_factory=list)
    scatter_apply: List[Tuple[int, int, int, int]] = field(default_factory=list)
    """(param index, start, end, receive offset): where each received update piece lands."""
    scatter_matrices: List[Tuple[int, bool]] = field(default_factory=list)
    """Per piece of ``scatter_apply``: (position of its job in ``jobs``, whether the piece is
    the matrix's own elements and not a copy of them: a matrix every tensor-parallel rank
    holds whole is read from TP rank 0 and written to every copy). What a rule needs that
    reduces over the holders of each matrix (Hyperball's weight norm)."""
    stacks: List[Stack] = field(default_factory=list)
    """The owned single-rank jobs' matrices grouped by shape (:func:`stacks`)."""
    gather_remote: bool = False
    scatter_remote: bool = False
    """Whether any rank of the group sends anything in this chunk's gather / scatter (the
    same answer on every rank: it comes from the shared plan). If not, no collective runs."""


def rank_messages(plan: Plan, local_starts: Sequence[int], sizes: Sequence[Optional[int]]) -> List[ChunkMessages]:
    """Every chunk's :class:`ChunkMessages` for this rank (``plan.group.rank``);
    ``local_starts[p]``: where this rank's master of param ``p`` starts in the param's flat
    storage (the plan's segments are in those coordinates), ``sizes[p]`` its numel (None
    where this rank holds none). Checked with :func:`check_coverage`."""
    g = plan.group
    me = g.rank

    def local(job: Job, seg: Segment) -> Piece:
        base = local_starts[job.param_index]
        return job.param_index, seg.start - base, seg.end - base

    out = []
    for chunk in plan.chunks:
        owned = [job for job in chunk.jobs if job.owner == me]
        pos = {job.index: i for i, job in enumerate(owned)}
        msg = ChunkMessages(index=chunk.index, jobs=chunk.jobs, owned=owned)
        send: List[list] = [[] for _ in range(g.size)]
        recv: List[list] = [[] for _ in range(g.size)]
        out_: List[list] = [[] for _ in range(g.size)]
        back: List[list] = [[] for _ in range(g.size)]
        for job_pos, job in enumerate(chunk.jobs):
            source_tps = {seg.tp for seg in job.sources}
            for seg in job.sources:
                holder = g.rank_of(seg.tp, seg.dp)
                msg.gather_remote |= holder != job.owner
                if holder == me:
                    send[job.owner].append(local(job, seg))
                if job.owner == me:
                    recv[holder].append((pos[job.index], seg))
            for seg in job.dests:
                holder = g.rank_of(seg.tp, seg.dp)
                msg.scatter_remote |= holder != job.owner
                if job.owner == me:
                    out_[holder].append((pos[job.index], seg.tp, seg.piece_offset, seg.numel))
                if holder == me:
                    back[job.owner].append((local(job, seg), (job_pos, seg.tp in source_tps)))
        msg.gather_send = [item for items in send for item in items]
        msg.gather_send_splits = [sum(e - s for _, s, e in items) for items in send]
        offset = 0
        for items in recv:
            for job_pos, seg in items:
                msg.gather_place.append((job_pos, seg.tp, seg.piece_offset, offset, seg.numel))
                offset += seg.numel
        msg.gather_recv_splits = [sum(seg.numel for _, seg in items) for items in recv]
        msg.scatter_send = [item for items in out_ for item in items]
        msg.scatter_send_splits = [sum(item[3] for item in items) for items in out_]
        offset = 0
        for items in back:
            for (param_index, start, end), matrix in items:
                msg.scatter_apply.append((param_index, start, end, offset))
                msg.scatter_matrices.append(matrix)
                offset += end - start
        msg.scatter_recv_splits = [sum(e - s for (_, s, e), _ in items) for items in back]
        msg.stacks = stacks(msg)
        out.append(msg)
    _assign_momentum(out, sizes)
    check_coverage(out, sizes)
    return out


def stacks(msg: ChunkMessages) -> List[Stack]:
    """The owned matrices of ``msg`` that one rank orthogonalizes, grouped by shape (in
    order of first appearance), each group's layout in the gather's receive buffer and the
    scatter's send buffer where it is contiguous (:class:`Stack`)."""
    groups: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for i, job in enumerate(msg.owned):
        if not job.ns_ranks:
            for k in range(job.matrix.column_groups):
                groups.setdefault(job.matrix.ns_shape, []).append((i, k))
    arrivals: Dict[int, List[Tuple[int, int, int, int]]] = {}
    for i, tp, piece_offset, recv_offset, numel in msg.gather_place:
        arrivals.setdefault(i, []).append((tp, piece_offset, recv_offset, numel))
    departures: Dict[int, List[Tuple[int, int, int, int]]] = {}
    offset = 0
    for i, tp, piece_offset, numel in msg.scatter_send:
        departures.setdefault(i, []).append((tp, piece_offset, offset, numel))
        offset += numel
    out = []
    for shape, members in groups.items():
        whole = [
            (i, k) for i, k in members if msg.owned[i].matrix.column_groups == 1 and _single_piece(msg.owned[i].matrix)
        ]
        contiguous = len(whole) == len(members)
        out.append(
            Stack(
                shape,
                tuple(members),
                received=_span([arrivals.get(i, []) for i, _ in members], shape) if contiguous else None,
                sent=_span([departures.get(i, []) for i, _ in members], shape) if contiguous else None,
            )
        )
    return out


def _single_piece(matrix: LogicalMatrix) -> bool:
    """Whether the matrix is one TP rank's piece whole (what travels is the matrix itself)."""
    return matrix.replicated or len(matrix.pieces) == 1


def _span(runs: List[List[Tuple[int, int, int, int]]], shape: Tuple[int, int]) -> Optional[Tuple[int, int]]:
    """The buffer range ``[start, end)`` holding the members' matrices one after another,
    each whole and in order, given each member's ``(tp, piece offset, buffer offset,
    numel)`` runs; None if they are not laid out so."""
    numel = shape[0] * shape[1]
    start = runs[0][0][2] if runs and runs[0] else None
    position = start
    for member in runs:
        piece = 0
        for tp, piece_offset, offset, n in member:
            if tp != member[0][0] or piece_offset != piece or offset != position:
                return None
            piece += n
            position += n
        if piece != numel:
            return None
    return (start, position) if start is not None else None


def _assign_momentum(messages: List[ChunkMessages], sizes: Sequence[Optional[int]]) -> None:
    """Each range's momentum advances in the first chunk that sends it (ranges sent again by
    a later chunk are kept from there); held ranges that no chunk sends, in the first chunk."""
    first: Dict[Piece, ChunkMessages] = {}
    for msg in messages:
        for piece in msg.gather_send:
            if piece not in first:
                first[piece] = msg
                msg.momentum.append(piece)
            elif first[piece] is not msg and piece not in first[piece].kept:
                first[piece].kept.append(piece)
    if not messages:
        return
    sent: Dict[int, List[Tuple[int, int]]] = {}
    for p, s, e in first:
        sent.setdefault(p, []).append((s, e))
    for p, size in enumerate(sizes):
        end = 0
        for s, e in sorted(sent.get(p, [])):
            if s > end:
                messages[0].momentum.append((p, end, s))
            end = max(end, e)
        if size and end < size:
            messages[0].momentum.append((p, end, size))


def check_coverage(messages: Sequence[ChunkMessages], sizes: Sequence[Optional[int]]) -> None:
    """Every element of every held master (``sizes[p]``: its numel, None where this rank
    holds none) advances its momentum once and receives exactly one update piece; anything
    else would update an element twice or never (a planner bug, never a user error)."""
    for what, pieces in (
        ("momentum", [p for m in messages for p in m.momentum]),
        ("update", [(p, s, e) for m in messages for p, s, e, _ in m.scatter_apply]),
    ):
        by_param: Dict[int, List[Tuple[int, int]]] = {}
        for p, s, e in pieces:
            by_param.setdefault(p, []).append((s, e))
        for p, size in enumerate(sizes):
            end = 0
            for s, e in sorted(by_param.get(p, [])):
                if s != end:
                    break
                end = e
            if (size or 0) != end or sum(e - s for s, e in by_param.get(p, [])) != (size or 0):
                raise AssertionError(f"the plan's {what} pieces of Muon param {p} overlap or leave gaps")
