"""Multi-rank Newton–Schulz: one large matrix orthogonalized by several ranks together.

When a pipeline stage has few Muon matrices and many ranks, the largest matrix sets the
step time while most ranks wait (DeepSeek-V3's dense ``fc1``, 7168 x 36864, is about 42
TFLOP of a 5-step Newton–Schulz on one GPU). The planner may then give such a matrix to an
aligned block of ``g`` ranks (consecutive ranks of the orthogonalization group, so one
node when ``g`` divides the GPUs per node; ``g`` a power of two up to
``MuonConfig.muon_ns_max_ranks``), chosen by :func:`place_multirank_jobs` from the FLOPs
and the priced bytes (:class:`MultirankCost`).

The algebra is that of Megatron-core's "distributed" tensor-parallel Newton–Schulz: with
the wide orientation ``X = [X_1 | ... | X_g]`` cut into column blocks (the long side),
``X X^T = sum_i X_i X_i^T``, and every step's update ``X_i <- a X_i + (b A + c A A) X_i``
needs only its own block and the small ``k x k`` matrix ``A``. So per step each member
computes its block's Gram matrix, the group **all-reduces** it (in fp32) and every member
updates its block (:func:`block_step`). ``A`` is symmetric, so only its block upper
triangle travels (:func:`gram_upper_numel`: about 53% of ``k^2``).

Communication (:func:`multirank_newton_schulz`), inside the block of ranks only: the job's
owner (the *leader*) has gathered the whole matrix as for any job; it normalises it (fp32
norm), zero-pads the long side to a multiple of ``g`` and **scatters** the column blocks;
``steps`` all-reduces of ``A``; the leader **gathers** the blocks back and goes on as for
any job. The standard iteration always (not Gram NS), never compiled; the result equals
one-rank Newton–Schulz up to the order of the Gram sums (fp32: ~1e-7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

GRAM_ROW_BLOCKS = 16
"""Row blocks of the Gram matrix whose upper triangle the all-reduce sends: block row ``i``
sends its columns from its own diagonal block on, ``(n + 1) / (2 n)`` of ``k^2`` in all
(``n`` blocks: 53% at 16); more blocks send less but cost more small copies."""


def _gram_row_blocks(k: int) -> List[Tuple[int, int]]:
    """The (start, end) rows of the Gram matrix's row blocks (at most ``k`` blocks)."""
    n = min(GRAM_ROW_BLOCKS, k)
    bounds = [k * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def gram_upper_numel(k: int) -> int:
    """Elements of a ``k x k`` Gram matrix that multi-rank Newton–Schulz all-reduces: each row
    block from its diagonal to the last column."""
    return sum((end - start) * (k - start) for start, end in _gram_row_blocks(k))


def _pack_upper(A: torch.Tensor) -> torch.Tensor:
    """The block upper triangle of ``A``, row block after row block, flat."""
    return torch.cat([A[start:end, start:].reshape(-1) for start, end in _gram_row_blocks(A.size(0))])


def _unpack_symmetric(packed: torch.Tensor, k: int) -> torch.Tensor:
    """``A`` from :func:`_pack_upper`'s output: the block upper triangle in place, then each
    row block's left part mirrored from the columns above it."""
    A = packed.new_empty(k, k)
    offset = 0
    for start, end in _gram_row_blocks(k):
        numel = (end - start) * (k - start)
        A[start:end, start:] = packed[offset : offset + numel].view(end - start, k - start)
        offset += numel
    for start, end in _gram_row_blocks(k):
        A[start:end, :start] = A[:start, start:end].mT
    return A


def block_step(X: torch.Tensor, A: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """One Newton–Schulz step of a member's ``k x w`` block: ``a X + (b A + c A A) X``.

    Forms ``A A`` (``2 k^3`` FLOPs, then ``2 k^2 w``) only when the block is wider than
    ``A`` is tall; a narrower block takes ``b (A X) + c A (A X)`` (``4 k^2 w``), the same
    polynomial with no ``k x k`` product."""
    if X.size(1) > X.size(0):
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        return torch.addmm(X, B, X, beta=a)
    AX = A @ X
    return torch.addmm(AX, A, AX, beta=b, alpha=c).add_(X, alpha=a)


def member_flops(rows: int, cols: int, steps: int, ranks: int, batch: int = 1) -> int:
    """Newton–Schulz FLOPs of each of ``ranks`` members sharing ``batch`` ``rows x cols``
    matrices (``k = min``, ``l = max`` side, blocks of ``w = l / g`` columns): per step the
    block's Gram matrix (``2 k^2 w``) and :func:`block_step` (``2 k^3 + 2 k^2 w`` where
    ``w > k``, else ``4 k^2 w``)."""
    k, l = min(rows, cols), max(rows, cols)
    width = math.ceil(l / ranks)
    step = 2 * k**3 + 2 * k * k * width if width > k else 4 * k * k * width
    return batch * steps * (2 * k * k * width + step)


def multirank_traffic(rows: int, cols: int, steps: int, ranks: int, elem_bytes: int, batch: int = 1) -> Dict[str, int]:
    """Bytes one multi-rank job adds: ``scatter`` is what the leader sends (``g - 1`` of ``g``
    padded blocks in the compute dtype), ``gather`` what each other member sends back (one
    block), ``all_reduce`` what each member sends in a ring all-reduce of ``A``'s block upper
    triangle (fp32, :func:`gram_upper_numel`) over all steps."""
    k, l = min(rows, cols), max(rows, cols)
    block = k * math.ceil(l / ranks) * elem_bytes
    return dict(
        scatter=batch * (ranks - 1) * block,
        gather=batch * block,
        all_reduce=batch * steps * (2 * (ranks - 1) * gram_upper_numel(k) * 4 // ranks),
    )


@dataclass(frozen=True)
class MultirankCost:
    """What multi-rank Newton–Schulz's blocking traffic costs, in the NS FLOPs a rank could
    have done meanwhile: FLOPs per byte sent over an intra-node and an inter-node link
    (``MuonConfig.muon_ns_intra_node_flops_per_byte`` and ``..._inter_node_...``; the
    defaults here, 0, price it by its FLOPs alone). Nodes come from the group."""

    intra_flops_per_byte: float = 0.0
    inter_flops_per_byte: float = 0.0

    def per_byte(self, members: Sequence[int], group) -> float:
        """FLOPs per byte at the link class of ``members``: intra-node if all share a node."""
        one_node = len({group.node_of(r) for r in members}) == 1
        return self.intra_flops_per_byte if one_node else self.inter_flops_per_byte

    def flops(
        self, rows: int, cols: int, steps: int, members: Sequence[int], group, elem_bytes: int, batch: int = 1
    ) -> float:
        """Member FLOPs plus the FLOP-equivalent of the leader's blocking bytes (its scatter
        of the blocks and its share of the all-reduces), at the link class of ``members``."""
        nbytes = multirank_traffic(rows, cols, steps, len(members), elem_bytes, batch)
        return member_flops(rows, cols, steps, len(members), batch) + self.per_byte(members, group) * (
            nbytes["scatter"] + nbytes["all_reduce"]
        )

    def rank_flops(self, jobs: Sequence, loads: Sequence[int], steps: int, group, elem_bytes: int = 2) -> List[float]:
        """Each rank's NS FLOPs ``loads`` plus the FLOP-equivalent of the blocking bytes it
        sends for the multi-rank jobs among ``jobs``: what bounds the step, in one unit."""
        priced = [float(x) for x in loads]
        for job in jobs:
            if not job.ns_ranks:
                continue
            rows, cols = job.matrix.ns_shape
            nbytes = multirank_traffic(rows, cols, steps, len(job.ns_ranks), elem_bytes, job.matrix.column_groups)
            per_byte = self.per_byte(job.ns_ranks, group)
            priced[job.ns_ranks[0]] += per_byte * nbytes["scatter"]
            for r in job.ns_ranks:
                priced[r] += per_byte * (nbytes["all_reduce"] + (nbytes["gather"] if r != job.ns_ranks[0] else 0))
        return priced


def place_multirank_jobs(
    jobs: Sequence,
    group,
    max_ranks: int,
    steps: int,
    owner_aligned: bool = False,
    cost: Optional[MultirankCost] = None,
    elem_bytes: int = 2,
) -> List[int]:
    """Spread the jobs that alone exceed a rank's mean Newton–Schulz load over several
    ranks; return the loads.

    A job whose FLOPs exceed ``total / ranks`` would bound the step on its own. For each
    power-of-two ``g <= max_ranks`` it takes the aligned block of ``g`` consecutive group
    ranks with the least load so far and prices it with ``cost`` (:class:`MultirankCost`:
    member FLOPs plus the blocking bytes at the block's link class, ``elem_bytes`` per
    element of the blocks). It takes the smallest ``g`` whose price fits under the mean,
    else the cheapest, and only if that price is below the job's FLOPs on one rank: a
    spread whose all-reduces take longer than the FLOPs they save is not made. Among the
    least-loaded blocks it takes the one holding most of the matrix (a matrix larger than a
    node's DP shards then crosses nodes only for the part outside the block's node). Its
    owner (leader) is the block's rank that holds most of the matrix. Sets ``job.ns_ranks``
    (leader first), ``job.owner`` and ``job.flops`` (per member); other jobs are left to
    ``assign_owners``. Only jobs any rank may own (exact mode) are spread.
    ``owner_aligned`` (owner-aligned buffers): only blocks
    with a rank that holds some of the matrix, so the gather to the leader and the scatter
    back stay where the buffer layout put the matrix.
    """
    loads = [0] * group.size
    cost = cost or MultirankCost()
    limit = min(max_ranks, group.size)
    if limit < 2:
        return loads
    mean = sum(job.flops for job in jobs) / group.size
    for job in sorted(jobs, key=lambda j: (-j.flops, j.index)):
        if job.flops <= mean:
            break
        if job.owner_tp is not None:
            continue
        rows, cols = job.matrix.ns_shape
        batch = job.matrix.column_groups
        held = job.held_elements(group)
        options = []  # (price, g, members)
        g = 2
        while g <= limit and g <= max(rows, cols):
            blocks = [list(range(start, start + g)) for start in range(0, group.size - g + 1, g)]
            if owner_aligned:
                blocks = [b for b in blocks if any(held.get(r, 0) for r in b)] or blocks
            # Among the least-loaded blocks, the one holding most of the matrix: its pieces
            # there never leave the block (one node), so the gather and scatter cross least.
            members = min(blocks, key=lambda b: (max(loads[r] for r in b), -sum(held.get(r, 0) for r in b), b[0]))
            options.append((cost.flops(rows, cols, steps, members, group, elem_bytes, batch), g, members))
            g *= 2
        fitting = [o for o in options if o[0] <= mean]
        best = fitting[0] if fitting else min(options, key=lambda o: (o[0], o[1]), default=None)
        if best is None or best[0] >= job.flops:
            continue
        _, g, members = best
        leader = min(members, key=lambda r: (-held.get(r, 0), r))
        job.ns_ranks = tuple([leader] + [r for r in members if r != leader])
        job.owner = leader
        job.flops = member_flops(rows, cols, steps, g, batch)
        for r in members:
            loads[r] += job.flops
    return loads


def multirank_newton_schulz(
    G: Optional[torch.Tensor],
    shape: Tuple[int, int],
    group: dist.ProcessGroup,
    members: Sequence[int],
    leader: int,
    schedule: Sequence[Tuple[float, float, float]],
    ns_dtype: torch.dtype,
    device: Optional[torch.device],
    eps: float = 1e-7,
) -> Optional[torch.Tensor]:
    """Newton–Schulz of one ``shape`` matrix by the ranks ``members`` (sorted group ranks;
    ``group``: their process group) with the ``(a, b, c)`` ``schedule``. ``G``: the matrix
    on the ``leader``, None on the others. Returns the result on the leader (``G``'s
    dtype), None elsewhere. Collective over ``group``: every member calls it for the same
    jobs in the same order."""
    g = len(members)
    src = list(members).index(leader)
    k, l = min(shape), max(shape)
    width = math.ceil(l / g)
    X = _scatter_blocks(G, k, width, g, group, src, ns_dtype, device, eps)
    for a, b, c in schedule:
        # A = sum over members of X_i X_i^T: one fp32 all-reduce of its block upper triangle.
        packed = _pack_upper((X @ X.mT).float())
        dist.all_reduce(packed, group=group)
        X = block_step(X, _unpack_symmetric(packed, k).to(ns_dtype), a, b, c)
    return _gather_blocks(X, G, l, g, group, src)


def _scatter_blocks(G, k: int, width: int, g: int, group, src: int, ns_dtype, device, eps) -> torch.Tensor:
    """Leader: normalise the wide orientation (norm in fp32, as ``newton_schulz``), pad the
    long side to ``g * width`` with zero columns, send block ``i`` to member ``i``."""
    block = torch.empty(k, width, dtype=ns_dtype, device=device if G is None else G.device)
    blocks = None
    if G is not None:
        X = (G.mT if G.size(0) > G.size(1) else G).float()
        X = (X / (torch.linalg.matrix_norm(X) + eps)).to(ns_dtype)
        X = torch.nn.functional.pad(X, (0, width * g - X.size(1)))
        blocks = [b.contiguous() for b in X.split(width, dim=1)]
    dist.scatter(block, blocks, group=group, group_src=src)
    return block


def _gather_blocks(X: torch.Tensor, G, l: int, g: int, group, src: int) -> Optional[torch.Tensor]:
    """Every member sends its block to the leader, which drops the padding and undoes the
    transpose."""
    gathered = [torch.empty_like(X) for _ in range(g)] if G is not None else None
    dist.gather(X.contiguous(), gathered, group=group, group_dst=src)
    if G is None:
        return None
    X = torch.cat(gathered, dim=1)[:, :l]
    return (X.mT if G.size(0) > G.size(1) else X).to(G.dtype)
