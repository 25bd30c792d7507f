"""Split Newton–Schulz: one large matrix orthogonalized by several ranks together.

When a pipeline stage has few Muon matrices and many ranks, the largest matrix sets the
step time while most ranks wait (DeepSeek-V3's dense ``fc1``, 7168 x 36864, is about 42
TFLOP of a 5-step Newton–Schulz on one GPU). The planner may then give such a matrix to an
aligned block of ``g`` ranks (consecutive ranks of the orthogonalization group, so one
node when ``g`` divides the GPUs per node; ``g`` a power of two up to
``MuonConfig.muon_split_ns_max_ranks``), chosen from the FLOPs (:func:`place_split_jobs`).

The algebra is that of Megatron-core's "distributed" tensor-parallel Newton–Schulz: with
the wide orientation ``X = [X_1 | ... | X_g]`` cut into column blocks (the long side),
``X X^T = sum_i X_i X_i^T``, and every step's update ``X_i <- a X_i + (b A + c A A) X_i``
needs only its own block and the small ``k x k`` matrix ``A``. So per step each member
computes its block's Gram matrix, the group **all-reduces** it (in fp32) and every member
updates its block (:func:`block_step`): through ``b A + c A A`` where the block is wider
than ``A`` (``2 k^3`` FLOPs, redundantly on each member), else as ``b (A X_i) + c A (A
X_i)``, two products with the narrow block instead (the large matrices that are split have
blocks narrower than ``k``: DeepSeek-V3's attention out-projection over 8 ranks, 2048
columns against ``k = 7168``, does 0.55x the FLOPs this way). ``A`` is
symmetric, so only its block upper triangle travels (:func:`gram_upper_numel`: about 53%
of ``k^2`` with :data:`GRAM_ROW_BLOCKS` row blocks) and each member mirrors the blocks
below the diagonal blocks: the same fp32 sums of the same partial Grams.

Communication around it (:class:`SplitNewtonSchulz`), inside the split group only:

1. the job's owner (the *leader*) has gathered the whole matrix as for any job; it takes
   the Frobenius norm in fp32, normalises, casts to the compute dtype, zero-pads the long
   side to a multiple of ``g`` (zero columns add nothing to ``A`` and stay zero) and
   **scatters** the column blocks;
2. ``steps`` all-reduces of ``A``;
3. the leader **gathers** the blocks back and goes on as for an unsplit job (scale,
   scatter of the update pieces to their holders).

Split jobs always run the standard iteration (not Gram NS) and are not compiled. The
result equals unsplit Newton–Schulz up to the order of the Gram sums (fp32: ~1e-7).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .newton_schulz import resolve_coefficients

__all__ = [
    "SplitCost", "SplitNewtonSchulz", "block_step", "gram_upper_numel", "member_flops", "place_split_jobs",
    "split_traffic",
]

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
    """Elements of a ``k x k`` Gram matrix that split Newton–Schulz all-reduces: each row
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
    """Newton–Schulz FLOPs of each of ``ranks`` members splitting ``batch`` ``rows x cols``
    matrices (``k = min``, ``l = max`` side, blocks of ``w = l / g`` columns): per step the
    block's Gram matrix (``2 k^2 w``) and :func:`block_step` (``2 k^3 + 2 k^2 w`` where
    ``w > k``, else ``4 k^2 w``)."""
    k, l = min(rows, cols), max(rows, cols)
    width = math.ceil(l / ranks)
    step = 2 * k**3 + 2 * k * k * width if width > k else 4 * k * k * width
    return batch * steps * (2 * k * k * width + step)


def split_traffic(rows: int, cols: int, steps: int, ranks: int, elem_bytes: int, batch: int = 1) -> Dict[str, int]:
    """Bytes one split job adds: ``scatter`` is what the leader sends (``g - 1`` of ``g``
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
class SplitCost:
    """What split Newton–Schulz's blocking traffic costs, in the NS FLOPs a rank could have
    done meanwhile: FLOPs per byte sent over an intra-node and an inter-node link, and the
    node of each group rank (``MuonConfig.muon_split_ns_intra_flops_per_byte`` and
    ``..._inter_...``; the defaults here, 0, price split NS by its FLOPs alone)."""

    intra_flops_per_byte: float = 0.0
    inter_flops_per_byte: float = 0.0
    node_of: Callable[[int], int] = lambda group_rank: 0

    def per_byte(self, members: Sequence[int]) -> float:
        """FLOPs per byte at the link class of ``members``: intra-node if all share a node."""
        one_node = len({self.node_of(r) for r in members}) == 1
        return self.intra_flops_per_byte if one_node else self.inter_flops_per_byte

    def flops(self, rows: int, cols: int, steps: int, members: Sequence[int], elem_bytes: int, batch: int = 1) -> float:
        """Member FLOPs plus the FLOP-equivalent of the leader's blocking bytes (its scatter
        of the blocks and its share of the all-reduces), at the link class of ``members``."""
        nbytes = split_traffic(rows, cols, steps, len(members), elem_bytes, batch)
        return (member_flops(rows, cols, steps, len(members), batch)
                + self.per_byte(members) * (nbytes["scatter"] + nbytes["all_reduce"]))

    def rank_flops(self, jobs: Sequence, loads: Sequence[int], steps: int, elem_bytes: int = 2) -> List[float]:
        """Each rank's NS FLOPs ``loads`` plus the FLOP-equivalent of the blocking bytes it
        sends for the split jobs among ``jobs``: what bounds the step, in one unit."""
        priced = [float(x) for x in loads]
        for job in jobs:
            if not job.split:
                continue
            rows, cols = job.matrix.ns_shape
            nbytes = split_traffic(rows, cols, steps, len(job.split), elem_bytes, job.matrix.column_groups)
            per_byte = self.per_byte(job.split)
            priced[job.split[0]] += per_byte * nbytes["scatter"]
            for r in job.split:
                priced[r] += per_byte * (nbytes["all_reduce"] + (nbytes["gather"] if r != job.split[0] else 0))
        return priced


def place_split_jobs(
    jobs: Sequence, group, max_ranks: int, steps: int, holders_only: bool = False,
    cost: Optional[SplitCost] = None, elem_bytes: int = 2,
) -> List[int]:
    """Split the jobs that alone exceed a rank's mean Newton–Schulz load; return the loads.

    A job whose FLOPs exceed ``total / ranks`` would bound the step on its own. For each
    power-of-two ``g <= max_ranks`` it takes the aligned block of ``g`` consecutive group
    ranks with the least load so far and prices it with ``cost`` (:class:`SplitCost`:
    member FLOPs plus the blocking bytes at the block's link class, ``elem_bytes`` per
    element of the blocks). It takes the smallest ``g`` whose price fits under the mean,
    else the cheapest, and splits only if that price is below the unsplit job's FLOPs: a
    split whose all-reduces take longer than the FLOPs they save is left whole. Among the
    least-loaded blocks it takes the one holding most of the matrix (a matrix larger than a
    node's DP shards then crosses nodes only for the part outside the block's node). Its
    owner (leader) is the block's rank that holds most of the matrix. Sets ``job.split`` (leader first), ``job.owner`` and
    ``job.flops`` (per member); other jobs are left to ``assign_owners``. Only jobs any rank
    may own (exact mode) are split. ``holders_only`` (owner-aligned buffers): only blocks
    with a rank that holds some of the matrix, so the gather to the leader and the scatter
    back stay where the buffer layout put the matrix.
    """
    loads = [0] * group.size
    cost = cost or SplitCost()
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
            if holders_only:
                blocks = [b for b in blocks if any(held.get(r, 0) for r in b)] or blocks
            # Among the least-loaded blocks, the one holding most of the matrix: its pieces
            # there never leave the block (one node), so the gather and scatter cross least.
            members = min(blocks, key=lambda b: (max(loads[r] for r in b), -sum(held.get(r, 0) for r in b), b[0]))
            options.append((cost.flops(rows, cols, steps, members, elem_bytes, batch), g, members))
            g *= 2
        fitting = [o for o in options if o[0] <= mean]
        best = fitting[0] if fitting else min(options, key=lambda o: (o[0], o[1]), default=None)
        if best is None or best[0] >= job.flops:
            continue
        _, g, members = best
        leader = min(members, key=lambda r: (-held.get(r, 0), r))
        job.split = tuple([leader] + [r for r in members if r != leader])
        job.owner = leader
        job.flops = member_flops(rows, cols, steps, g, batch)
        for r in members:
            loads[r] += job.flops
    return loads


_GROUPS: Dict[Tuple[int, ...], dist.ProcessGroup] = {}


def _split_group(global_ranks: Tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of these global ranks, created once per process: only members
    call this, so the group is made with ``use_local_synchronization``, whose name is a hash
    of the ranks; creating it a second time (another optimizer, a rebuilt pipeline) would
    reuse that name and hang."""
    if global_ranks not in _GROUPS:
        _GROUPS[global_ranks] = dist.new_group(list(global_ranks), use_local_synchronization=True)
    return _GROUPS[global_ranks]


class SplitNewtonSchulz:
    """Runs this rank's part of the plan's split jobs (see the module docstring).

    Built with the pipeline, on every rank of the orthogonalization group; each rank
    creates the process groups of the split groups it belongs to
    (``use_local_synchronization``: only members take part).
    """

    def __init__(
        self, plan, steps: int, coefficients, ns_dtype: torch.dtype, device: Optional[torch.device] = None,
        traffic: Optional[Dict[str, int]] = None, eps: float = 1e-7,
    ) -> None:
        self.me = plan.group.rank
        self.device = device
        self.steps = steps
        self.schedule = resolve_coefficients(coefficients).schedule(steps)
        self.ns_dtype = ns_dtype
        self.eps = eps
        global_ranks = dist.get_process_group_ranks(plan.group.group)
        self.groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
        for job in plan.jobs:
            members = tuple(sorted(job.split))
            if self.me in members and members not in self.groups:
                self.groups[members] = _split_group(tuple(global_ranks[r] for r in members))
        self.traffic: Dict[str, int] = traffic if traffic is not None else defaultdict(int)
        """Bytes this rank sent: ``split_scatter`` / ``split_gather`` (the leader's blocks, a
        member's block back), ``split_all_reduce`` (ring estimate)."""

    def run(self, jobs: Sequence, matrices: Dict[int, List[torch.Tensor]]) -> Dict[int, List[torch.Tensor]]:
        """Take part in every split job of ``jobs`` this rank belongs to, in job order (the
        same order on every member, so the blocking collectives pair up). ``matrices``:
        the assembled inputs of the jobs this rank owns. Returns the results of the jobs
        this rank leads."""
        out: Dict[int, List[torch.Tensor]] = {}
        for job in sorted(jobs, key=lambda j: j.index):
            if self.me not in job.split:
                continue
            leader = job.split[0] == self.me
            results = []
            for k in range(job.matrix.column_groups):
                G = matrices[job.index][k] if leader else None
                results.append(self.orthogonalize(G, job.matrix.ns_shape, tuple(sorted(job.split)), job.split[0]))
            if leader:
                out[job.index] = results
        return out

    def orthogonalize(
        self, G: Optional[torch.Tensor], shape: Tuple[int, int], members: Tuple[int, ...], leader: int
    ) -> Optional[torch.Tensor]:
        """Newton–Schulz of one ``shape`` matrix by the group ``members`` (sorted group
        ranks). ``G``: the matrix on the ``leader``, None on the others; returns the result
        on the leader (``G``'s dtype), None elsewhere."""
        group, g = self.groups[members], len(members)
        src = members.index(leader)
        k, l = min(shape), max(shape)
        width = math.ceil(l / g)
        X = self._scatter_blocks(G, k, width, g, group, src)
        X = self._iterate(X, group, g)
        return self._gather_blocks(X, G, l, g, group, src)

    def _scatter_blocks(self, G, k: int, width: int, g: int, group, src: int) -> torch.Tensor:
        """Leader: normalise the wide orientation (norm in fp32, as ``newton_schulz``), pad
        the long side to ``g * width`` with zero columns, send block ``i`` to member ``i``."""
        block = torch.empty(k, width, dtype=self.ns_dtype, device=self.device if G is None else G.device)
        blocks = None
        if G is not None:
            X = (G.mT if G.size(0) > G.size(1) else G).float()
            X = (X / (torch.linalg.matrix_norm(X) + self.eps)).to(self.ns_dtype)
            X = torch.nn.functional.pad(X, (0, width * g - X.size(1)))
            blocks = [b.contiguous() for b in X.split(width, dim=1)]
            self.traffic["split_scatter"] += (g - 1) * block.numel() * block.element_size()
        dist.scatter(block, blocks, group=group, group_src=src)
        return block

    def _iterate(self, X: torch.Tensor, group, g: int) -> torch.Tensor:
        """The steps on this member's block: ``A = sum over members of X_i X_i^T`` (one fp32
        all-reduce of its block upper triangle), then :func:`block_step`."""
        k = X.size(0)
        for a, b, c in self.schedule:
            packed = _pack_upper((X @ X.mT).float())
            dist.all_reduce(packed, group=group)
            self.traffic["split_all_reduce"] += 2 * (g - 1) * packed.numel() * 4 // g
            A = _unpack_symmetric(packed, k).to(self.ns_dtype)
            X = block_step(X, A, a, b, c)
        return X

    def _gather_blocks(self, X: torch.Tensor, G, l: int, g: int, group, src: int) -> Optional[torch.Tensor]:
        """Every member sends its block to the leader, which drops the padding and undoes
        the transpose."""
        gathered = [torch.empty_like(X) for _ in range(g)] if G is not None else None
        if G is None:
            self.traffic["split_gather"] += X.numel() * X.element_size()
        dist.gather(X.contiguous(), gathered, group=group, group_dst=src)
        if G is None:
            return None
        X = torch.cat(gathered, dim=1)[:, :l]
        return (X.mT if G.size(0) > G.size(1) else X).to(G.dtype)
