"""Muon's update rule in one place: :class:`MuonRule`, its stages, and the Newton–Schulz
kernels of its orthogonalization.

For one logical matrix ``W`` (fp32 master) with gradient ``G`` and momentum ``B``, the
distributed step (``pipeline.py``) runs each stage where its data is:

1. :meth:`~MuonRule.before`, on every rank holding part of the matrix, on its ranges (fp32):
   ``B <- mu B + G``, and the orthogonalization input ``U = G + mu B`` (Nesterov) or ``B``;
2. :meth:`~MuonRule.orthogonalize`, on the rank that owns the whole matrix: Newton–Schulz
   ``O ~ polar(U)`` (same shapes as one batched call; a matrix planned over several ranks
   with them, :meth:`~MuonRule.orthogonalize_across`);
3. :meth:`~MuonRule.after`, on the owner: variance reduction if on, times the update scale:
   the update ``O'``, written in the wire dtype it travels back in;
4. :meth:`~MuonRule.apply`, on every holder, on its ranges: decoupled weight decay
   ``W <- W - lr wd W`` (cautious: only where ``O' W >= 0``), then ``W <- W - lr O'``.

A **variant** of Muon is a subclass in a module of its own that overrides the stages it
changes, says which configs it serves (:meth:`~MuonRule.enabled`), declares any state it
keeps in ``state.MUON_STATES``, and is listed in ``optimizer.RULE_VARIANTS``
(``hyperball.py`` is one; docs/design.md, "How to add a variant"). The stages see only what
their rank holds: a rule that needs a whole-matrix quantity on the holders reduces it over
the orthogonalization group itself (Hyperball's weight norm).

The Newton–Schulz kernels are here because they are the rule's orthogonalization; their
coefficient sets, the choice between standard and Gram NS and their FLOP counts are in
``newton_schulz.py``, which the planner and the benchmarks read without the kernels.

Newton–Schulz replaces ``G = U S V^T`` by (an approximation of) ``U V^T`` with matrix
products only: scale ``G`` by its Frobenius norm (taken in fp32), then ``steps`` times
``A = X X^T``, ``X <- a X + (b A + c A A) X`` (each singular value ``s`` becomes
``a s + b s^3 + c s^5``); a tall ``G`` is transposed so that ``X X^T`` is the smaller Gram
matrix. Gram Newton–Schulz iterates on ``R = X X^T`` and the accumulated ``Q``
(``X_k = Q_k X_0``), restarting every ``GRAM_RESTART_STEPS`` steps, in fp16 for a 16-bit
compute dtype (``newton_schulz.py`` has the why).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .config import update_scale
from .multirank_newton_schulz import multirank_newton_schulz
from .newton_schulz import (
    GRAM_RESTART_STEPS,
    CoefficientSet,
    Triple,
    choose_method,
    resolve_coefficients,
)
from .planner import ChunkMessages, Job
from .process_groups import OrthoGroup
from .state import MOMENTUM, SECOND_MOMENT, OwnerStates

NS_EPS = 1e-7
"""Added to the Frobenius norm Newton–Schulz divides by, so an all-zero matrix maps to zero."""


# ---------------------------------------------------------------------------------------
# Newton–Schulz kernels
# ---------------------------------------------------------------------------------------


def _iterate(G: torch.Tensor, schedule: Tuple[Triple, ...], compute_dtype: torch.dtype, eps: float, gram: bool):
    """Newton–Schulz of ``G`` (or of each matrix of a stack): ``G`` (transposed if tall)
    over its Frobenius norm, then the standard iteration on ``X``, or with ``gram`` the
    iteration on ``R = X X^T`` and the accumulated ``Q`` (module docstring), restarting
    every ``GRAM_RESTART_STEPS`` steps; the result in the dtype it ran in."""
    dtype = gram_dtype(compute_dtype) if gram else compute_dtype
    tall = G.size(-2) > G.size(-1)
    X = G.mT if tall else G
    # The norm is taken in fp32: a bf16 sum of squares over a large matrix loses digits,
    # and an underestimated norm would push singular values above 1, where p() diverges.
    # Both ops read a 16-bit G as it is and compute in fp32 (the division stores straight
    # into the compute dtype): the bits of normalising an fp32 copy, without the copy.
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(X.dtype, torch.float32))
    # empty_like keeps a tall G's transposed strides: the products below read X in the
    # memory order they always have (another order sums in another order).
    X = torch.div(X, norm + eps, out=torch.empty_like(X, dtype=dtype))
    # addmm/baddbmm fold the scale-and-add into the GEMM: one bf16 rounding instead of
    # three (about half the bf16 error of the plain expression) and no extra kernels. The
    # triples are Python floats fixed for a given config: torch.compile bakes them into the
    # graph once (nothing here varies per training step, so nothing recompiles).
    fma = torch.baddbmm if X.ndim == 3 else torch.addmm
    if not gram:
        for a, b, c in schedule:
            A = X @ X.mT
            B = fma(A, A, A, beta=b, alpha=c)  # b*A + c*A@A
            X = fma(X, B, X, beta=a)  # a*X + B@X
        return X.mT if tall else X
    for start in range(0, len(schedule), GRAM_RESTART_STEPS):
        segment = schedule[start : start + GRAM_RESTART_STEPS]
        R = X @ X.mT
        Q: Optional[torch.Tensor] = None
        for i, (a, b, c) in enumerate(segment):
            # P = a I + Z is never formed: a*I folds into each product's scale-and-add
            # (one rounding per product, as in the standard iteration).
            Z = fma(R, R, R, beta=b, alpha=c)  # b*R + c*R@R
            if Q is None:  # Q starts as I: the first step's product is free
                Q = Z.clone()
                Q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                Q = fma(Q, Z, Q, beta=a)  # P Q
            if i + 1 < len(segment):  # the last step of a segment needs no R
                PR = fma(R, Z, R, beta=a)  # P R
                R = fma(PR, PR, Z, beta=a)  # P R P
        X = Q @ X
    return X.mT if tall else X


def gram_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype Gram NS computes in: fp32, or fp16 for any 16-bit ``compute_dtype``."""
    return torch.float32 if compute_dtype == torch.float32 else torch.float16


_KERNELS: Dict[str, Callable[..., torch.Tensor]] = {
    "standard": functools.partial(_iterate, gram=False),
    "gram": functools.partial(_iterate, gram=True),
}


@functools.lru_cache(maxsize=None)
def _compiled_kernel(method: str) -> Callable[..., torch.Tensor]:
    # Compiled lazily and once per process and method; guards then specialise per
    # shape/schedule/dtype.
    return torch.compile(_KERNELS[method])


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: Union[str, CoefficientSet] = "quintic",
    compute_dtype: torch.dtype = torch.bfloat16,
    eps: float = NS_EPS,
    compiled: bool = False,
    method: str = "standard",
    keep_compute_dtype: bool = False,
) -> torch.Tensor:
    """Approximate the polar factor ``U V^T`` of ``G`` (or of each matrix of a stack).

    Args:
        G: ``[m, n]`` matrix or ``[B, m, n]`` stack of same-shape matrices; the stack is
            processed with batched matmuls, each matrix normalised by its own norm.
        steps: number of Newton–Schulz iterations (0 returns the normalised input).
        coefficients: a name from ``newton_schulz.COEFFICIENT_SETS`` or a ``CoefficientSet``.
        compute_dtype: dtype of the iteration (bf16 by default; fp32 for exactness). Gram
            NS computes in fp16 for any 16-bit dtype (module docstring).
        eps: added to the Frobenius norm so an all-zero matrix maps to zero, not NaN.
        compiled: run a ``torch.compile``-d kernel (compiled on first use, then cached).
        method: ``"standard"`` (iterate on ``X``), ``"gram"`` (iterate on ``X X^T``;
            fewer FLOPs for wide matrices) or ``"auto"`` (by aspect ratio, see
            ``newton_schulz.choose_method``).
        keep_compute_dtype: return the result in the dtype the iteration ran in (Gram NS:
            :func:`gram_dtype`) instead of casting it to ``G``'s: a caller that scales and
            casts it anyway saves a pass over the matrices, and no rounding is added.

    Returns:
        A tensor of ``G``'s shape, in ``G``'s dtype (or the compute dtype).
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a 2-D matrix or 3-D stack, got shape {tuple(G.shape)}.")
    if steps < 0:
        raise ValueError(f"newton_schulz steps must be >= 0, got {steps}.")
    method = choose_method(G.size(-2), G.size(-1), method)
    schedule = resolve_coefficients(coefficients).schedule(steps)
    kernel = _compiled_kernel(method) if compiled else _KERNELS[method]
    X = kernel(G, schedule, compute_dtype, eps)
    return X if keep_compute_dtype else X.to(G.dtype)


# ---------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------

Member = Tuple[Job, int]
"""(job, column group): one logical matrix of a stack the owner orthogonalizes."""


class MuonRule:
    """Muon's update of the logical matrices, in four stages (module docstring), built once
    from a ``MuonConfig``. It holds the settings the stages read and no per-step state: the
    optimizer state comes in as arguments (``state.py`` keeps it)."""

    @classmethod
    def enabled(cls, config) -> bool:
        """Whether this rule is the one ``config`` asks for (a variant: its switch is on)."""
        return True

    def __init__(self, config, ns_method: Optional[str] = None) -> None:
        self.config = config
        self.momentum: float = config.muon_momentum
        self.nesterov: bool = config.muon_nesterov
        self.coefficients: CoefficientSet = resolve_coefficients(config.muon_coefficient_type)
        """The Newton–Schulz coefficient set, resolved once (its ``schedule`` per step count)."""
        self.ns_steps: int = config.muon_num_ns_steps
        self.ns_dtype: torch.dtype = config.muon_ns_dtype
        self.ns_method: str = ns_method or config.muon_ns_method
        """The iteration on the optimizer's device, as the optimizer resolved it once
        (``newton_schulz.method_for_device``: 'auto' is standard on a CPU)."""
        self.compiled: bool = config.muon_use_torch_compile
        self.variance_reduction: Optional[float] = config.muon_variance_reduction
        self.cautious: bool = config.muon_cautious_weight_decay
        self.comm_dtype: torch.dtype = config.comm_dtype
        """The dtype the orthogonalization inputs and the updates travel in."""
        self._scales: Dict[Tuple[Tuple[float, ...], torch.device], torch.Tensor] = {}

    def check(self, jobs: Sequence[Job]) -> None:
        """Refuse, naming the fix, matrices of the plan this rule cannot update exactly
        (called once, when the optimizer is built)."""

    @property
    def schedule(self) -> Tuple[Triple, ...]:
        """The ``(a, b, c)`` triple of every Newton–Schulz step."""
        return self.coefficients.schedule(self.ns_steps)

    def scale(self, job: Job) -> float:
        """The update scale of ``job``'s matrices, from the logical matrix's full shape."""
        return update_scale(self.config, *job.matrix.scale_shape)

    # ------------------------------------------------------------------ 1. before
    def before(self, grads: List[torch.Tensor], states: Dict[str, List[torch.Tensor]]) -> List[torch.Tensor]:
        """Holder: the momentum of ranges of the masters (``grads``: their gradients;
        ``states``: each shard-kept state's views of the same ranges), updated in place;
        returns the orthogonalization inputs of the ranges (fp32)."""
        bufs = states[MOMENTUM]
        if bufs:
            torch._foreach_mul_(bufs, self.momentum)
            torch._foreach_add_(bufs, grads)
        return torch._foreach_add(grads, bufs, alpha=self.momentum) if self.nesterov and bufs else bufs

    # ------------------------------------------------------------------ 2. orthogonalize
    def orthogonalize(self, stack: torch.Tensor) -> torch.Tensor:
        """Owner: Newton–Schulz of a ``[B, m, n]`` stack of whole matrices (storage
        orientation), in its compute dtype."""
        method = choose_method(stack.size(-2), stack.size(-1), self.ns_method)
        kernel = _compiled_kernel(method) if self.compiled else _KERNELS[method]
        return kernel(stack, self.schedule, self.ns_dtype, NS_EPS)

    def orthogonalize_across(
        self,
        matrix: Optional[torch.Tensor],
        shape: Tuple[int, int],
        group: dist.ProcessGroup,
        members: Sequence[int],
        leader: int,
        device: Optional[torch.device],
    ) -> Optional[torch.Tensor]:
        """Newton–Schulz of one ``shape`` matrix by the ranks ``members`` (sorted; ``group``:
        theirs) together (``multirank_newton_schulz``); ``matrix`` on the ``leader`` (its
        owner), None elsewhere; the result on the leader."""
        return multirank_newton_schulz(matrix, shape, group, members, leader, self.schedule, self.ns_dtype, device)

    # ------------------------------------------------------------------ 3. after
    def after(
        self, ortho: torch.Tensor, members: Sequence[Member], states: OwnerStates, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Owner: the updates of a stack of orthogonalized matrices (``members[i]`` is
        ``ortho[i]``, storage orientation, in the compute dtype): variance reduction if on
        (its second moments in ``states``, updated), times each matrix's scale, computed in
        fp32 and stored into ``out`` (the wire dtype: one rounding, as if the fp32 result
        were packed) or a new fp32 stack."""
        if self.variance_reduction is not None:
            ortho = variance_reduce(states, members, ortho, self.variance_reduction)
        scales = self.scale_tensor(members, ortho.device)
        if out is None:
            out = torch.empty(ortho.shape, dtype=torch.float32, device=ortho.device)
        return torch.mul(ortho, scales, out=out)

    def scale_tensor(self, members: Sequence[Member], device: torch.device) -> torch.Tensor:
        """The members' update scales as an fp32 ``[B, 1, 1]`` tensor on ``device``, made
        once per stack: a host-to-device copy every step would wait for the device."""
        key = (tuple(self.scale(job) for job, _ in members), device)
        if key not in self._scales:
            self._scales[key] = torch.tensor(key[0], dtype=torch.float32, device=device).view(-1, 1, 1)
        return self._scales[key]

    # ------------------------------------------------------------------ 4. apply
    def apply(self, chunk: "AppliedChunk") -> None:
        """Holder: every master range of ``chunk`` decayed and updated (:func:`decay_and_update_`);
        the ranges of one (learning rate, weight decay) as one ``_foreach`` op each
        (cautious weight decay: range by range). The update stays in the wire dtype: the
        ops promote it to fp32 (exactly) as they read it."""
        groups: Dict[Tuple[float, float], Tuple[List[torch.Tensor], List[torch.Tensor]]] = defaultdict(lambda: ([], []))
        for master, update, lr_wd in zip(chunk.masters, chunk.updates, chunk.lr_wd):
            if self.cautious:
                decay_and_update_(master, update, *lr_wd, cautious=True)
            else:
                groups[lr_wd][0].append(master)
                groups[lr_wd][1].append(update)
        for (lr, wd), (masters, updates) in groups.items():
            if wd != 0.0:
                torch._foreach_mul_(masters, 1.0 - lr * wd)
            torch._foreach_add_(masters, updates, alpha=-lr)


@dataclass
class AppliedChunk:
    """What the apply stage of one chunk works on, on this rank: each master range it
    updates, with its update (on the master's device, in the wire dtype) and this step's
    (learning rate, weight decay); and, for a rule that needs whole matrices, which matrix
    each range is of and the group holding the rest of them."""

    masters: List[torch.Tensor]
    updates: List[torch.Tensor]
    lr_wd: List[Tuple[float, float]]
    matrices: List[Tuple[int, bool]]
    """Per range: (position of its job in ``msg.jobs``, whether the range is the matrix's own
    elements and not a copy of them: a matrix every tensor-parallel rank holds whole is
    read from TP rank 0 and written to every copy)."""
    msg: ChunkMessages
    """The chunk's messages (``jobs``: all of its jobs; ``owned``: those this rank owns)."""
    group: OrthoGroup
    """The orthogonalization group: every rank holding part of the chunk's matrices."""
    owner_states: OwnerStates
    """The owner-kept states of the matrices this rank owns."""
    device: Optional[torch.device]
    """The compute device (where a collective's buffer goes)."""


def decay_and_update_(master: torch.Tensor, update: torch.Tensor, lr: float, wd: float, cautious: bool) -> None:
    """``w -= lr * wd * w`` (cautious: only where ``update * w >= 0``, ``w`` before the
    step), then ``w -= lr * update``, in place on a range of an fp32 master (``update`` on
    its device)."""
    if wd != 0.0:
        if cautious:
            master.sub_(master * ((update * master) >= 0), alpha=lr * wd)
        else:
            master.mul_(1.0 - lr * wd)
    master.add_(update, alpha=-lr)


def variance_reduce(states: OwnerStates, members: Sequence[Member], ortho: torch.Tensor, beta2: float) -> torch.Tensor:
    """:func:`variance_reduction_` of every matrix of the stack in its logical orientation,
    each with its own second moment (``states``, updated); fp32."""
    out = torch.empty_like(ortho, dtype=torch.float32)
    for transposed in (False, True):
        rows = [i for i, (job, _) in enumerate(members) if job.matrix.transposed == transposed]
        if not rows:
            continue
        moments = torch.stack([states.get(SECOND_MOMENT, *members[i]) for i in rows]).to(ortho.device)
        stack = ortho[rows].mT if transposed else ortho[rows]
        reduced = variance_reduction_(stack, moments, beta2)
        out[rows] = reduced.mT if transposed else reduced
        for i, moment in zip(rows, moments):
            states.get(SECOND_MOMENT, *members[i]).copy_(moment)
    return out


def variance_reduction_(ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """nanochat's variance reduction of a ``[B, out, in]`` stack of orthogonalized updates
    (logical orientation). ``second_moment`` (``[B, out, 1]`` or ``[B, 1, in]``, fp32) is
    updated in place; returns the rescaled updates (fp32).

    ``v`` = mean of squares over the reduced dim (the input dim of a tall or square matrix,
    the output dim of a wide one); ``s <- beta2 * s + (1 - beta2) * v``; the update
    ``O * rsqrt(max(s, 1e-10))`` is rescaled so that its Frobenius norm is ``O``'s."""
    o = ortho.float()
    dim = -1 if o.shape[-2] >= o.shape[-1] else -2
    n = o.shape[dim]
    v_mean = o.square().mean(dim=dim, keepdim=True)
    norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(v_mean, 1.0 - beta2)
    scale = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = ((v_mean * n) * scale.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return o * (scale * (norm / new_norm.clamp_min(1e-10)))


__all__ = [
    "AppliedChunk",
    "MuonRule",
    "NS_EPS",
    "decay_and_update_",
    "gram_dtype",
    "newton_schulz",
    "variance_reduction_",
]
