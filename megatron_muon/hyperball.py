"""Muon-Hyperball (Wen, Dang, Lyu, Ma, Liang, arXiv 2606.16899): every logical matrix and
its update held at fixed Frobenius norms, instead of weight decay.

    W <- R * normalize(W - lr * R * normalize(U)),    normalize(X) = X / ||X||_F

``U`` is Muon's orthogonalized update of the matrix (after variance reduction, if on; the
update scale drops out), ``R`` the matrix's radius: its Frobenius norm when Hyperball first
steps it, or ``muon_hyperball_radius * sqrt(rows * cols)`` (an RMS) if given. The matrices
take no decoupled weight decay (``weight_decay`` still decays the AdamW parameters).

**Where the norms are computed.** ``U`` is whole on the rank that orthogonalizes it, so the
owner normalizes it (:meth:`Hyperball.after`: its norm in fp32) and scatters ``Û``. ``W`` is
not whole anywhere: its fp32 master is sharded like the distributed optimizer's (pieces of
each tensor-parallel slice on the data-parallel ranks, Megatron-FSDP's shards likewise). So
in the apply stage every holder sums over its pieces of each matrix of the chunk, and one
all-reduce over the orthogonalization group (four fp64 numbers per matrix) gives everyone

    a = ||W||^2,  b = <W, Û>,  c = ||Û||^2,  the owner's R (0 before the first step),

from which each holder scales its own pieces (:meth:`Hyperball.apply`):

    R' = R if R > 0 else sqrt(a)                    (the owner keeps R')
    ||W - lr R' Û||^2 = a - 2 lr R' b + (lr R')^2 c
    W <- (W - lr R' Û) * R' / ||W - lr R' Û||

A matrix every tensor-parallel rank holds whole (not TP-split) counts once (TP rank 0's
copy). The radius is an owner-kept state (``hyperball_radius`` in ``state.MUON_STATES``):
checkpoints store it expanded over the matrix, so it reshards like the second moment; a
checkpoint without it (Hyperball switched on since) starts it from the loaded weights.

Exact only with one owner per whole matrix: ``muon_tp_mode`` 'blockwise' would normalize
each shard, 'duplicated' each rank's copy of the update, and a unit of column groups
(legacy ``GroupedMLP`` with ``muon_split_glu``) mixes two matrices in every piece; each is
refused in one line.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .planner import Job
from .rule import AppliedChunk, Member, MuonRule, variance_reduce
from .state import HYPERBALL_RADIUS, OwnerStates

EPS = 1e-12
"""Floor of the norms Hyperball divides by (an all-zero update leaves ``W`` on its sphere)."""


class Hyperball(MuonRule):
    """Muon-Hyperball: Muon's ``before`` and ``orthogonalize``; ``after`` normalizes the
    update; ``apply`` steps on the sphere of each matrix's radius (module docstring)."""

    @classmethod
    def enabled(cls, config) -> bool:
        return bool(config.muon_hyperball)

    def check(self, jobs: Sequence[Job]) -> None:
        units = [job.matrix.param_name for job in jobs if job.matrix.column_groups > 1]
        if units:
            raise ValueError(
                f"muon_hyperball=True cannot be exact on {units[0]}: it stores gate and up of each expert as "
                "column groups of one unit (legacy GroupedMLP with muon_split_glu), and Hyperball needs each "
                "matrix's own norm; set muon_split_glu=False (--no-muon-split-glu) or use SequentialMLP / TEGroupedMLP."
            )

    def after(
        self, ortho: torch.Tensor, members: Sequence[Member], states: OwnerStates, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Owner: ``normalize(U)`` of each matrix (variance-reduced first, if on), its norm
        in fp32, stored into ``out`` (the wire dtype) or a new fp32 stack."""
        if self.variance_reduction is not None:
            ortho = variance_reduce(states, members, ortho, self.variance_reduction)
        norms = torch.linalg.vector_norm(ortho, dim=(-2, -1), keepdim=True, dtype=torch.float32).clamp_min(EPS)
        if out is None:
            out = torch.empty(ortho.shape, dtype=torch.float32, device=ortho.device)
        return torch.div(ortho, norms, out=out)

    def apply(self, chunk: AppliedChunk) -> None:
        """Holder: each matrix's norms reduced over the group, then every range stepped on
        its matrix's sphere (module docstring). Collective over the orthogonalization group."""
        jobs = chunk.msg.jobs
        sums = torch.zeros(4, len(jobs), dtype=torch.float64, device=chunk.device)
        own = [i for i, (_, whole) in enumerate(chunk.matrices) if whole]
        if own:
            slots = torch.tensor([chunk.matrices[i][0] for i in own], device=sums.device)
            masters = [chunk.masters[i] for i in own]
            updates = [chunk.updates[i].to(torch.float32) for i in own]
            parts = torch.stack(
                [
                    torch.stack(torch._foreach_norm(masters)).double().square(),
                    torch.stack([torch.dot(m, u) for m, u in zip(masters, updates)]).double(),
                    torch.stack(torch._foreach_norm(updates)).double().square(),
                ]
            ).to(sums.device)
            sums[:3].index_add_(1, slots, parts)
        owned = {job.index for job in chunk.msg.owned}
        for position, job in enumerate(jobs):
            if job.index in owned:
                sums[3, position] = self.radius(job, chunk.owner_states)
        if chunk.group.size > 1:
            dist.all_reduce(sums, group=chunk.group.group)
        w_sq, dot, u_sq, radius = sums
        radius = torch.where(radius > 0, radius, w_sq.sqrt())
        for position, job in enumerate(jobs):
            if job.index in owned:
                chunk.owner_states.get(HYPERBALL_RADIUS, job, 0).fill_(float(radius[position]))
        radius, w_sq, dot, u_sq = (t.tolist() for t in (radius, w_sq, dot, u_sq))
        for master, update, (lr, _), (position, _) in zip(chunk.masters, chunk.updates, chunk.lr_wd, chunk.matrices):
            r, step = radius[position], lr * radius[position]
            norm = math.sqrt(max(w_sq[position] - 2.0 * step * dot[position] + step * step * u_sq[position], 0.0))
            master.add_(update, alpha=-step)
            master.mul_(r / max(norm, EPS))

    def radius(self, job: Job, states: OwnerStates) -> float:
        """The owner's radius of ``job``'s matrix: the configured one, else the kept one
        (0 before its first step)."""
        if self.config.muon_hyperball_radius is not None:
            rows, cols = job.matrix.scale_shape
            return self.config.muon_hyperball_radius * math.sqrt(rows * cols)
        return float(states.get(HYPERBALL_RADIUS, job, 0))
