"""nanochat's Muon variants: variance reduction (NorMuon) and cautious weight decay.

Both act on whole logical matrices or on the fp32 master shards, never on the wire:

* **Variance reduction** (``MuonConfig.muon_variance_reduction`` = beta2) runs on the
  owner of each logical matrix, right after Newton–Schulz and before the update scale.
  Its state, a factored second moment (one fp32 value per row of a tall-or-square
  logical matrix, per column of a wide one), lives on that owner, keyed by the plan's job
  index, in :class:`SecondMoments`. For checkpoints the owners expand it to the
  parameter's shape and scatter it to the holders of each piece through the pipeline's
  own all-to-all (:meth:`SecondMoments.expanded_shards`), so it is saved in model
  coordinates like the momentum and reshards with the model; on load the holders gather
  it back to the (possibly different) owners (:meth:`SecondMoments.load_expanded_shards`).
* **Cautious weight decay** (``muon_cautious_weight_decay``) is applied by the holders
  of the master shards when an update piece arrives (:func:`apply_update_`).

The single-process reference (``megatron_muon.reference``) implements both on its own.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .planner import Job

MatrixKey = Tuple[int, int]
"""(job index, column group): one logical matrix of the plan."""


def reduced_dim(out_features: int, in_features: int) -> int:
    """The dim the second moment averages over, in logical ``(out, in)`` orientation:
    the input dim (-1) of a tall or square matrix, the output dim (-2) of a wide one."""
    return -1 if out_features >= in_features else -2


def variance_reduction_(ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """nanochat's variance reduction of a ``[B, out, in]`` stack of orthogonalized updates
    (logical orientation). ``second_moment`` (``[B, out, 1]`` or ``[B, 1, in]``, fp32) is
    updated in place; returns the rescaled updates (fp32).

    ``v`` = mean of squares over the reduced dim; ``s <- beta2 * s + (1 - beta2) * v``;
    the update ``O * rsqrt(max(s, 1e-10))`` is rescaled so that its Frobenius norm is
    ``O``'s (the norm measured over the whole matrix, in fp32)."""
    o = ortho.float()
    dim = reduced_dim(o.shape[-2], o.shape[-1])
    n = o.shape[dim]
    v_mean = o.square().mean(dim=dim, keepdim=True)
    norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(v_mean, 1.0 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = ((v_mean * n) * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return o * (step * (norm / new_norm.clamp_min(1e-10)))


def apply_update_(weight: torch.Tensor, update: torch.Tensor, lr: float, wd: float, cautious: bool) -> None:
    """``w -= lr * update``, after the decoupled decay ``lr * wd * w`` was applied where
    it applies: everywhere (``cautious=False``: the caller decayed the whole shard
    already) or, cautious, only where ``update * w >= 0`` (``w`` before the step)."""
    update = update.to(weight.device, weight.dtype)  # a CPU-offloaded master: the update comes over
    if cautious and wd != 0.0:
        agree = (update * weight) >= 0
        weight.sub_(weight * agree, alpha=lr * wd)
    weight.add_(update, alpha=-lr)


def _logical(matrix: torch.Tensor, job: Job) -> torch.Tensor:
    """A storage-orientation matrix (or stack) seen in logical ``(out, in)`` orientation."""
    return matrix.mT if job.matrix.transposed else matrix


def _moment_shape(job: Job) -> Tuple[int, int]:
    out_features, in_features = job.matrix.scale_shape
    return (out_features, 1) if reduced_dim(out_features, in_features) == -1 else (1, in_features)


class SecondMoments:
    """The factored second moments of the logical matrices this rank owns."""

    def __init__(self, beta2: float, device: Optional[torch.device], storage: Optional[torch.device] = None) -> None:
        """``device``: where the pipeline computes; ``storage``: where the state lives
        between steps (the CPU with ``muon_cpu_offload``, else ``device``)."""
        self.beta2 = beta2
        self.device = device
        self.storage = storage if storage is not None else device
        self.state: Dict[MatrixKey, torch.Tensor] = {}
        """(job index, column group) -> fp32 ``[out, 1]`` or ``[1, in]`` (logical orientation)."""

    def _get(self, job: Job, group: int) -> torch.Tensor:
        key = (job.index, group)
        if key not in self.state:
            self.state[key] = torch.zeros(_moment_shape(job), dtype=torch.float32, device=self.storage)
        return self.state[key]

    def __call__(self, members: Sequence[Tuple[Job, int]], ortho: torch.Tensor) -> torch.Tensor:
        """The pipeline's after-Newton–Schulz hook: ``ortho[i]`` is the orthogonalized
        matrix ``members[i]`` (storage orientation); returns the variance-reduced stack."""
        out = torch.empty_like(ortho, dtype=torch.float32)
        for transposed in (False, True):
            rows = [i for i, (job, _) in enumerate(members) if job.matrix.transposed == transposed]
            if not rows:
                continue
            moments = torch.stack([self._get(job, k) for job, k in (members[i] for i in rows)]).to(ortho.device)
            stack = ortho[rows].mT if transposed else ortho[rows]
            reduced = variance_reduction_(stack, moments, self.beta2)
            out[rows] = reduced.mT if transposed else reduced
            for (job, k), moment in zip((members[i] for i in rows), moments):
                self.state[(job.index, k)].copy_(moment)
        return out.to(ortho.dtype)

    # ------------------------------------------------------------------ checkpoints
    def expanded(self, job: Job) -> List[torch.Tensor]:
        """Per column group of ``job``: its second moment broadcast to the whole matrix
        (storage orientation, fp32), what the checkpoint stores in parameter coordinates."""
        rows, cols = job.matrix.ns_shape
        out = []
        for k in range(job.matrix.column_groups):
            logical = (cols, rows) if job.matrix.transposed else (rows, cols)
            full = self._get(job, k).to(self.device).expand(logical)
            out.append((full.mT if job.matrix.transposed else full).contiguous())
        return out

    def set_from_expanded(self, job: Job, matrices: List[torch.Tensor]) -> None:
        """Inverse of :meth:`expanded`: the factored values, read off one row or column
        (exact: no averaging of the identical copies)."""
        for k, matrix in enumerate(matrices):
            logical = _logical(matrix, job)
            shape = _moment_shape(job)
            value = logical[:, :1] if shape[1] == 1 else logical[:1, :]
            self._get(job, k).copy_(value)

    def expanded_shards(self, pipeline, shards: Sequence[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Collective over the orthogonalization group: every rank's piece of every Muon
        parameter's expanded second moment, shaped like its master shard ``shards[p]``."""
        out = [torch.zeros_like(s, dtype=torch.float32) if s is not None else None for s in shards]

        def put(param_index: int, start: int, end: int, piece: torch.Tensor) -> None:
            out[param_index][start:end] = piece

        pipeline.scatter_whole(self.expanded, put)
        return out

    def load_expanded_shards(self, pipeline, shards: Sequence[Optional[torch.Tensor]]) -> None:
        """Collective: the holders' expanded pieces travel to the owners, which keep the
        factored values (the inverse of :meth:`expanded_shards`)."""
        self.state.clear()
        for job, matrices in pipeline.gather_whole(shards):
            self.set_from_expanded(job, matrices)
