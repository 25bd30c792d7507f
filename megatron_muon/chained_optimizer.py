"""``MuonChainedOptimizer``: the dense and the expert Muon optimizers as one, step by step.

Megatron's ``get_megatron_optimizer`` chains one distributed optimizer per parameter kind
(dense, expert-parallel) in a ``ChainedOptimizer``; ``get_muon_optimizer`` does the same
with two :class:`~megatron_muon.optimizer.MuonDistributedOptimizer`. This chain keeps
Megatron's ``step()`` (gradient preparation, norm, clipping, zero counting) and writes the
update out in one function, :meth:`MuonChainedOptimizer.step_with_ready_grads`, calling
the two optimizers' parts in the order the data flows, so the expert step can run while
the dense pipeline's first gathers are in flight. It also ORs the non-finite checks of
both optimizers, counts skipped steps, and saves and loads checkpoints of both together.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.optimizer import ChainedOptimizer

from .non_finite import NonFiniteGradientError, SkipCounter, agreed_culprit
from .optimizer import MuonDistributedOptimizer, megatron_timer
from .qk_clip import QKClip


class MuonChainedOptimizer(ChainedOptimizer):
    """Megatron's ChainedOptimizer over our dense and expert optimizers, with our extras.

    ``step()`` is Megatron's: :meth:`prepare_grads` (ours), the grad norm over both
    optimizers, clipping and zero counting, then :meth:`step_with_ready_grads`, which
    schedules the update of both optimizers explicitly. With ``muon_overlap_expert_ns``
    the expert optimizer's step (its stacked per-expert Newton–Schulz) runs after the
    dense pipeline has launched its first gathers and before it waits for them, so that
    communication is hidden behind expert compute.
    """

    def __init__(self, chained_optimizers, events: Optional[List[Tuple[str, str, int]]] = None) -> None:
        super().__init__(chained_optimizers)
        self.events = events if events is not None else []
        self.num_steps = 0
        """Successful optimizer steps taken (saved in checkpoints)."""
        self.skips = SkipCounter(self.config.muon_max_consecutive_skipped_steps)
        """Steps skipped for non-finite gradients (``skips.skipped_steps``, ``skips.consecutive``)."""

    @property
    def trace(self) -> List[Tuple[str, str, int]]:
        """Stage events of the last step of every pipeline, in execution order."""
        return list(self.events)

    @property
    def qk_clip(self) -> Optional[QKClip]:
        return next((o.qk_clip for o in self.muon_optimizers if o.qk_clip is not None), None)

    @property
    def max_attention_logit(self) -> Optional[float]:
        """The largest attention logit of the last step (QK-Clip / logging), or None."""
        clip = self.qk_clip
        return clip.max_attention_logit if clip is not None else None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Check every chained optimizer, then update every loss scaler with the combined
        flag, so the dense and expert optimizers skip together and their scales stay equal
        (Megatron's chain would update each scaler with its own optimizer's flag)."""
        flags = [opt.unscale_and_check_grads() for opt in self.muon_optimizers]
        found = bool(torch.cat(flags).max().item() > 0)
        for opt in self.muon_optimizers:
            if opt.grad_scaler:
                opt.grad_scaler.update(found)
        return found

    @torch.no_grad()
    def step(self):
        """Megatron's chained step (``ChainedOptimizer.step``), in this order:

        1. :meth:`prepare_grads`: copy the grads into the fp32 main-grad shards, unscale,
           check for inf/NaN in every precision and update the loss scalers; a non-finite
           step returns ``(False, None, None)`` on every rank with all state untouched;
        2. Megatron's grad norm over both optimizers, clipping, ``grad_norm_skip_threshold``
           and zero counting;
        3. :meth:`step_with_ready_grads`: the update.

        Then the skip bookkeeping: the ``muon_max_consecutive_skipped_steps``-th
        non-finite step in a row raises
        :class:`~megatron_muon.non_finite.NonFiniteGradientError` on every rank."""
        try:
            result = super().step()
        finally:
            # A skipped step (inf/nan) still starts the next one with fresh recorders.
            if self.qk_clip is not None:
                self.qk_clip.reset()
        if result[0]:
            self.num_steps += 1
        skipped = not result[0] and result[1] is None  # (False, norm, ..) is Megatron's grad-norm skip
        counts = skipped and not any(opt.loss_scaler_can_back_off() for opt in self.muon_optimizers)
        if self.skips.record(skipped, counts):
            raise self._non_finite_error()
        return result

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The update of every chained optimizer, in the order the data flows.

        The dense pipeline launches its first gathers; while they travel, the expert
        optimizer takes its whole Muon step (with ``muon_overlap_expert_ns``; else after the
        dense pipeline); the dense pipeline's chunks run; then AdamW on the scalar shards,
        QK-Clip on the masters, the master -> model copy and Megatron's parameter
        all-gather."""
        self.events.clear()
        dense, expert = self.dense, self.expert
        overlap = expert is not None and self.config.muon_overlap_expert_ns
        with megatron_timer(self.config, "optimizer-inner-step"):
            dense_step = dense.launch_muon_step()
            if overlap:
                expert.muon_step()
            dense.complete_muon_step(dense_step)
            if expert is not None and not overlap:
                expert.muon_step()
            for opt in self.muon_optimizers:
                opt.adamw_step()
            dense.apply_qk_clip()
        with megatron_timer(self.config, "optimizer-copy-main-to-model-params"):
            for opt in self.muon_optimizers:
                opt._copy_main_params_to_model_params()
        for opt in self.muon_optimizers:
            opt.start_param_sync()
        if self.config.overlap_param_gather_with_optimizer_step:
            # As Megatron's chain: dispatch the first model chunk's all-gather now, so it
            # overlaps the rest of the iteration (after both optimizers' copies here).
            dense.model_chunks[0].start_param_sync(force_dispatch=True)
        return True

    def _non_finite_error(self) -> NonFiniteGradientError:
        """Collective over the grad-statistics group: every rank gets the same message."""
        names = [n for opt in self.muon_optimizers for n in opt.non_finite_grad_names()]
        culprit = agreed_culprit(names, self.muon_optimizers[0].get_grad_stats_parallel_group())
        return NonFiniteGradientError(
            f"{self.skips.consecutive} consecutive optimizer steps skipped for non-finite gradients "
            f"(inf/NaN), e.g. in parameter {culprit}; parameters and optimizer state are from the "
            "last good step. Lower the learning rate or check the data, or raise "
            "MuonConfig.muon_max_consecutive_skipped_steps (--muon-max-consecutive-skipped-steps; 0 = never raise)."
        )

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """Megatron dist-checkpointing state: every state tensor in model coordinates (see
        ``megatron_muon.checkpoint``), reshardable across TP/PP/EP/DP and expert layouts."""
        from .checkpoint import FORMAT, optimizer_sharded_state

        param_state: Dict[str, object] = {}
        for opt in self.muon_optimizers:
            param_state.update(optimizer_sharded_state(opt, model_sharded_state_dict, is_loading))
        cfg = self.config
        return {
            "format": FORMAT,
            "step": self.num_steps,
            "optimizers": {opt.name: opt.common_state() for opt in self.muon_optimizers},
            "muon_config": {
                k: (str(v) if isinstance(v, torch.dtype) else v)
                for k, v in vars(cfg).items()
                if (k.startswith("muon_") or k in ("lr", "min_lr", "weight_decay", "clip_grad", "bf16", "fp16"))
                and not callable(v)
            },
            "param_state": param_state,
        }

    def load_sharded(self, state_dict) -> None:
        """Load a state produced by ``sharded_state_dict`` (after dist_checkpointing.load)."""
        from .checkpoint import load_optimizer_state

        self.num_steps = int(state_dict["step"])
        commons = state_dict["optimizers"]
        for opt in self.muon_optimizers:
            load_optimizer_state(opt, state_dict["param_state"], self.num_steps)
            opt.load_common_state(commons.get(opt.name) or commons["dense"])

    def state_dict(self):
        """Per-rank state for a same-layout resume (see ``sharded_state_dict`` for resharding)."""
        return {"chained": super().state_dict(), "num_steps": self.num_steps}

    def load_state_dict(self, state_dict):
        from .checkpoint import FORMAT

        if isinstance(state_dict, dict) and "chained" in state_dict:
            super().load_state_dict(state_dict["chained"])
            self.num_steps = int(state_dict["num_steps"])
            return
        if isinstance(state_dict, dict) and state_dict.get("format") == FORMAT:
            self.load_sharded(state_dict)  # the result of dist_checkpointing.load
            return
        super().load_state_dict(state_dict)

    @property
    def dense(self) -> MuonDistributedOptimizer:
        return next(o for o in self.muon_optimizers if o.name == "dense")

    @property
    def expert(self) -> Optional[MuonDistributedOptimizer]:
        return next((o for o in self.muon_optimizers if o.name == "expert"), None)

    @property
    def muon_optimizers(self) -> List[MuonDistributedOptimizer]:
        return [o for o in self.chained_optimizers if isinstance(o, MuonDistributedOptimizer)]

    @property
    def traffic(self) -> Dict[str, int]:
        total: Dict[str, int] = {}
        for opt in self.muon_optimizers:
            for k, v in opt.traffic.items():
                total[k] = total.get(k, 0) + v
        return total

    def reset_traffic(self) -> None:
        for opt in self.muon_optimizers:
            opt.reset_traffic()
