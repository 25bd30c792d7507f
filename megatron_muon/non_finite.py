"""Non-finite gradients: find them in every precision, agree on every rank, name the culprit.

Megatron's distributed optimizer checks for inf/nan only when it has a loss scaler (fp16,
or an explicit ``loss_scale``): a bf16 or fp32 run would step on a NaN gradient and spread
it through Newton–Schulz into every Muon matrix. ``MuonDistributedOptimizer`` therefore
checks always (``MuonDistributedOptimizer.unscale_and_check_grads``), with the same fused
kernel Megatron uses for unscaling (``torch._amp_foreach_non_finite_check_and_unscale_``, a
unit scale without a scaler) over the grads of this rank's fp32 masters, then all-reduces
the flag (MAX) over the optimizer's grad-statistics group (every tensor-, pipeline- and
data-parallel rank of the optimizer instance), so all ranks take the same decision. The chained optimizer ORs the flags of its
dense and expert optimizers before any loss scaler is updated.

:class:`SkipCounter` counts skipped steps and raises :class:`NonFiniteGradientError`, naming a
parameter whose gradient is not finite, after ``muon_max_consecutive_skipped_steps``
consecutive skips that no loss scaler can cure.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist


class NonFiniteGradientError(RuntimeError):
    """Training cannot continue: gradients stayed non-finite for too many steps."""


def local_non_finite_names(named_grads: Iterable[Tuple[str, Optional[torch.Tensor]]]) -> List[str]:
    """Names whose (local shard of the) gradient holds an inf or NaN, in order."""
    return [name for name, grad in named_grads if grad is not None and not bool(torch.isfinite(grad).all())]


def agreed_culprit(local_names: List[str], group: Optional[dist.ProcessGroup]) -> str:
    """The first non-finite parameter name any rank of ``group`` found (same on every rank)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local_names[0] if local_names else "<unknown>"
    found: List[Optional[List[str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, local_names[:4], group=group)
    for rank, names in enumerate(found):
        if names:
            global_rank = dist.get_global_rank(group, rank)
            return f"{names[0]} (on rank {global_rank})"
    return "<none now: the gradients were non-finite only before this rank's shard>"


class SkipCounter:
    """Skipped-step bookkeeping of one optimizer: totals, the current streak, the limit."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        """Steps skipped for non-finite gradients since construction."""
        self.consecutive = 0
        """Current streak of skips that count toward the limit."""

    def record(self, skipped: bool, counts: bool) -> bool:
        """Record one step; True when the streak reached the limit (the caller raises)."""
        if not skipped:
            self.consecutive = 0
            return False
        self.skipped_steps += 1
        if counts:
            self.consecutive += 1
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive
