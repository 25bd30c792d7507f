"""The Muon optimizer: Megatron's sharded mixed-precision optimizer with exact, distributed Muon for the
matrices, dense and expert-parallel parameters chained as ``get_megatron_optimizer`` does.

Megatron already does everything around the update that a Megatron user relies on: fp32
master weights and optimizer state sharded over the data-parallel ranks, the copy of the
reduce-scattered gradients into the masters, loss scaling, the global grad norm and
clipping, the master -> model copy and the parameter all-gather.
:class:`MuonDistributedOptimizer` is a Megatron ``MixedPrecisionOptimizer`` (one for dense,
one for expert-parallel parameters: loss scale, grad norm, clipping, ``step()``) and
:class:`MuonChainedOptimizer` subclasses Megatron's ``ChainedOptimizer``, keeping its
``step()``. Where the masters, gradients and parameters live is the data-parallel engine's:
each optimizer holds a storage backend (``storage/``) that builds what its engine needs (under
DDP a Megatron ``DistributedOptimizer`` of its own, which shards the parameter groups into
the masters and makes the copies; under Megatron-FSDP the engine's own main weights) and
asks it for the copies, the parameter sync and the checkpoint format.

Before the update, :meth:`MuonChainedOptimizer.prepare_grads` copies the gradients into the
masters and checks for inf/NaN in every precision: a step with a non-finite gradient is
skipped on every rank, and too many in a row raise (``non_finite.py``). The update itself is
:meth:`MuonChainedOptimizer.step_with_ready_grads`:

1. this step's Muon work begun (``pipeline.StepWork``: one generator per chunk of both
   optimizers, running the stages of the rule, ``rule.py``);
2. AdamW on the scalar parameters (embeddings, output layer, norms, biases, the router);
3. QK-Clip's row factors;
4. the schedule (``pipeline.RunNow``): every chunk (momentum, gather, Newton–Schulz,
   scatter, decay and update; the expert chunks while the first dense gathers travel),
   QK-Clip's scaling of the fp32 masters, the backend's master -> model copy and parameter
   sync (CPU-offloaded masters are staged on the device chunk by chunk, scaled and written
   into the model's parameters there: ``state.OffloadedMasters``). With
   ``muon_step_overlap='forward'`` the schedule is a ``pipeline.PendingStep``: only every
   chunk's momentum now, the rest when the next forward's parameter sync needs it.

The rule is plain Muon or the variant the config asks for (:data:`RULE_VARIANTS`).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from torch.profiler import record_function

from .config import MuonConfig
from .hyperball import Hyperball
from .matrices import MuonParam, unwrap
from .newton_schulz import method_for_device
from .non_finite import NonFiniteGradientError, SkipCounter, agreed_culprit, local_non_finite_names
from .pipeline import MuonPipeline, PendingStep, RunNow, StepWork, side_stream
from .planner import Plan, plan_for_config, plan_statistics, rank_messages
from .process_groups import build_ortho_group, subgroup
from .qk_clip import QKClip
from .rule import MuonRule
from .state import OffloadedMasters, OwnerStates, ShardStates, init_adam_states, muon_states
from .storage import StorageBackend, storage_for
from .timers import megatron_timer

logger = logging.getLogger(__name__)

RULE_VARIANTS: Tuple[Type[MuonRule], ...] = (Hyperball,)
"""Muon's variants (``rule.py``): the first whose ``enabled(config)`` holds is the rule; plain
Muon otherwise. ``MuonConfig`` refuses settings that turn on two."""


def muon_rule(config: MuonConfig, ns_method: str) -> MuonRule:
    """The rule ``config`` asks for, running the Newton–Schulz iteration ``ns_method`` (the
    optimizer's, resolved for its device), built once per optimizer."""
    return next((variant for variant in RULE_VARIANTS if variant.enabled(config)), MuonRule)(config, ns_method)


class MuonAdamW(torch.optim.AdamW):
    """The inner torch optimizer of a ``MuonDistributedOptimizer`` (and of the Megatron
    ``DistributedOptimizer`` its DDP storage holds, which replaces its groups' parameters by
    this rank's fp32 master shards).

    It holds every parameter group, so Megatron's learning-rate scheduler and checkpoints
    see them all; a group flagged ``group['muon']`` keeps the Muon state of its fp32
    masters (``momentum_buffer``, ``step``), which the Muon step updates. ``step()`` is
    AdamW over the other (scalar) groups only."""

    def __init__(self, param_groups: List[dict], config: MuonConfig) -> None:
        super().__init__(
            param_groups,
            lr=config.lr if config.lr is not None else 1e-3,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on the scalar groups (the Muon groups are left alone)."""
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon", False)]
        try:
            super().step()
        finally:
            self.param_groups = groups

    @property
    def muon_groups(self) -> List[dict]:
        return [g for g in self.param_groups if g.get("muon", False)]


def init_state(opt: MuonAdamW, config=None) -> None:
    """Megatron's ``init_state_fn``: AdamW's state allocated (``state.init_adam_states``)."""
    init_adam_states(opt)


class MuonDistributedOptimizer(MixedPrecisionOptimizer):
    """Megatron's mixed-precision optimizer (loss scale, grad norm, clipping, zero counting,
    ``step()``) whose matrix parameters are updated by exact, distributed Muon, for one kind
    of parameters (dense or expert-parallel). Its fp32 masters and the copies between them
    and the model are its storage backend's (:attr:`storage`: under DDP a Megatron
    ``DistributedOptimizer`` that the backend holds). Construct with
    :func:`~megatron_muon.get_muon_optimizer`."""

    def __init__(
        self,
        optimizer: MuonAdamW,
        config: MuonConfig,
        grad_scaler,
        model_chunks: List[torch.nn.Module],
        data_parallel_group: dist.ProcessGroup,
        data_parallel_group_gloo: Optional[dist.ProcessGroup],
        data_parallel_group_idx: int,
        tp_group: dist.ProcessGroup,
        muon_params: Sequence[MuonParam],
        name: str = "dense",
        qk_clip: Optional[QKClip] = None,
        owner_aligned: bool = False,
        storage: Optional[Type[StorageBackend]] = None,
        grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
        grad_norm_tp_groups: Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]] = (None, None),
    ) -> None:
        super().__init__(optimizer, config, grad_scaler, init_state)
        self.name = name
        self.qk_clip = qk_clip
        self._alone: Optional[MuonChainedOptimizer] = None
        self.owner_aligned = owner_aligned
        """DDP was built with ``owner_aligned_param_layout``: owners stay at the DP index holding each matrix."""
        self.model_chunks = model_chunks
        self.is_stub_optimizer = False
        if grad_stats_parallel_group is not None:
            # As in get_megatron_optimizer: grad statistics over the whole optimizer instance.
            self.grad_stats_parallel_group = grad_stats_parallel_group
        # Megatron's grad norm reads them to count TP-duplicated parameters once.
        self.tp_group, self.expert_tp_group = grad_norm_tp_groups
        self.muon_params = list(muon_params)
        self.muon_param_ids = {id(mp.param) for mp in self.muon_params}
        self.masters_offload: Optional[OffloadedMasters] = None
        """The fp32 masters of the Muon matrices in a CPU pool (``muon_cpu_offload`` with
        Megatron's ``optimizer_cpu_offload``)."""
        self.storage: StorageBackend = (storage or storage_for(model_chunks))(
            self, data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx
        )
        """Where the masters, gradients and parameters live (the data-parallel engine's); it
        shards the parameter groups of :attr:`optimizer` into this rank's masters."""
        self.shard_map = self.storage.shard_map
        """Who holds which range of every parameter, and this rank's fp32 masters."""
        self.ns_method = method_for_device(
            config.muon_ns_method, self.muon_params[0].param.device if self.muon_params else None
        )
        """The Newton–Schulz iteration on this device (``muon_ns_method`` 'auto' is standard on a CPU)."""
        self.plan = self._plan(tp_group, owner_aligned)
        self.muon = self._muon_pipeline()

    # ------------------------------------------------------------------ construction
    def _plan(self, tp_group: dist.ProcessGroup, owner_aligned: bool) -> Plan:
        """The ownership plan, identical on every rank of the orthogonalization group."""
        group = build_ortho_group(tp_group, self.storage.data_parallel_group)
        for mp in self.muon_params:
            if mp.param not in self.shard_map:
                raise ValueError(
                    f"Muon parameter {mp.name} is not in any DDP buffer given to this optimizer; wrap every "
                    "model chunk in megatron.core.distributed.DistributedDataParallel before building the optimizer."
                )
        dp_ranges = {i: self.shard_map[mp.param].dp_ranges for i, mp in enumerate(self.muon_params)}
        plan = plan_for_config(self.config, self.muon_params, dp_ranges, group, owner_aligned, self.ns_method)
        if group.size > 1:
            prints = [None] * group.size
            dist.all_gather_object(prints, plan.fingerprint(), group=group.group)
            if len(set(prints)) != 1:
                raise RuntimeError(
                    f"Ranks of the {self.name} orthogonalization group derived different Muon plans: the model "
                    "chunks differ in structure between tensor/data-parallel ranks. Build the same model on every rank."
                )
        return plan

    def _muon_pipeline(self) -> MuonPipeline:
        """Everything the Muon step reads: this rank's messages of the plan, masters, state, the rule."""
        cfg: MuonConfig = self.config
        shards = [self.shard_map[mp.param] for mp in self.muon_params]
        masters = [s.master for s in shards]
        device = self.muon_params[0].param.device if self.muon_params else None
        messages = rank_messages(
            self.plan, [s.start for s in shards], [m.numel() if m is not None else None for m in masters]
        )
        if cfg.optimizer_cpu_offload:
            float16 = self.storage.float16_masters()
            self.masters_offload = OffloadedMasters(float16, self.storage.model_ranges(float16), device)
            self.masters_offload.stage_for(masters, messages)
        me = self.plan.group.rank
        rule = muon_rule(cfg, self.ns_method)
        rule.check(self.plan.jobs)
        return MuonPipeline(
            group=self.plan.group,
            messages=messages,
            masters=masters,
            shard_states=ShardStates(
                [s.name for s in muon_states(cfg, "shard")],
                masters,
                self.optimizer.state,
                messages,
                cfg.muon_cpu_offload,
                device,
            ),
            owner_states=OwnerStates(
                muon_states(cfg, "owner"), torch.device("cpu") if cfg.muon_cpu_offload else device
            ),
            rule=rule,
            device=device,
            max_inflight=cfg.muon_max_inflight_chunks,
            subgroups={
                tuple(sorted(j.ns_ranks)): subgroup(self.plan.group, j.ns_ranks)
                for j in self.plan.jobs
                if me in j.ns_ranks
            },
            offloaded_masters=self.masters_offload,
        )

    def plan_statistics(self) -> Dict[str, object]:
        return plan_statistics(self.plan)

    # ------------------------------------------------------------------ stepped alone
    @property
    def alone(self) -> "MuonChainedOptimizer":
        """A chain of this optimizer alone: what its Megatron ``step()`` runs (every step of
        ours is the chain's, so stepped alone it steps as a chain of one)."""
        if self._alone is None:
            self._alone = MuonChainedOptimizer([self])
        return self._alone

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Megatron's pre-step hook: True (skip the step) when any rank's gradient is non-finite."""
        return self.alone.prepare_grads()

    def _copy_main_params_to_model_params(self) -> None:
        self.storage.copy_masters_to_model()

    def _copy_model_params_to_main_params(self, state_dict=None) -> None:
        """Megatron's ``reload_model_params``: the masters from the model's parameters."""
        self.storage.copy_model_to_masters(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.storage.zero_grad(set_to_none)

    def non_finite_grad_names(self) -> List[str]:
        """Names of the model params whose master grad on this rank is non-finite."""
        names = {}
        for i, chunk in enumerate(self.model_chunks):
            prefix = f"chunk{i}." if len(self.model_chunks) > 1 else ""
            names.update({id(p): prefix + n for n, p in unwrap(chunk).named_parameters()})
        return local_non_finite_names(
            (names.get(id(shard.param), "<unnamed>"), shard.master.grad)
            for shard in self.shard_map
            if shard.master is not None
        )

    def loss_scaler_can_back_off(self) -> bool:
        """True while a dynamic loss scaler can still lower its scale (fp16): its skips are
        its normal work, not a sign that training is broken."""
        scaler = self.grad_scaler
        return scaler is not None and hasattr(scaler, "min_scale") and bool(scaler.scale > scaler.min_scale)

    # ------------------------------------------------------------------ the update
    def muon_lr_wd(self) -> List[Tuple[float, float]]:
        """This step's (learning rate, weight decay) of every Muon param (from its group)."""
        lr_wd = {id(p): (g["lr"], g["weight_decay"]) for g in self.optimizer.muon_groups for p in g["params"]}
        return [lr_wd[id(m)] if m is not None else (0.0, 0.0) for m in self.muon.masters]

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """This optimizer's update when it steps alone (Megatron's ``step()`` calls this
        after preparing and clipping the gradients): the chain's :func:`update`."""
        if self.qk_clip is not None:
            raise NotImplementedError(
                "With QK-Clip, step the MuonChainedOptimizer that get_muon_optimizer returned: its step() "
                "resets the max-logit recorders after every step, taken or skipped."
            )
        return self.alone.step_with_ready_grads()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        raise NotImplementedError(
            "megatron_muon saves optimizer state only as a distributed checkpoint: call "
            "sharded_state_dict() on the MuonChainedOptimizer (or megatron_muon.checkpoint.save_checkpoint)."
        )

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        raise NotImplementedError(
            "Call sharded_state_dict() on the MuonChainedOptimizer that get_muon_optimizer "
            "returned: the dense and expert optimizers are saved together, in model coordinates."
        )

    def load_state_dict(self, state_dict):
        raise NotImplementedError(
            "Call load_state_dict() on the MuonChainedOptimizer that get_muon_optimizer returned, with "
            "what its sharded_state_dict() was loaded into."
        )

    def common_state(self) -> Dict[str, object]:
        """Non-tensor state for checkpoints: the grad scaler and the parameter groups'
        settings (what Megatron's AdamW needs if the checkpoint is converted back)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None, "param_groups": groups}

    def load_common_state(self, common: Dict[str, object]) -> None:
        if self.grad_scaler and common.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(common["grad_scaler"])


class MuonChainedOptimizer(ChainedOptimizer):
    """Megatron's ChainedOptimizer over our dense and expert optimizers.

    ``step()`` is Megatron's: :meth:`prepare_grads` (ours), the grad norm over both
    optimizers, clipping and zero counting, then :meth:`step_with_ready_grads`. With
    ``muon_step_overlap='forward'`` part of the update is left in :attr:`pending` for the
    next forward; :meth:`finish_pending_step` runs it at once."""

    def __init__(self, chained_optimizers, step_overlap: str = "none") -> None:
        super().__init__(chained_optimizers)
        self.pending: Optional[PendingStep] = None
        """With ``muon_step_overlap='forward'``: the schedule, holding what the last step left
        for the next forward."""
        if step_overlap == "forward":
            self.pending = PendingStep(self.muon_optimizers, side_stream(self.config, self.dense.muon.device))
        self.schedule = self.pending if self.pending is not None else RunNow(self.muon_optimizers)
        """Where the Muon step runs: ``pipeline.RunNow`` or ``pipeline.PendingStep``."""
        self.work: Optional[StepWork] = None
        self.previous_work: Optional[StepWork] = None
        """The last step taken and the one before it (what the update RMS is read from)."""
        self.num_steps = 0
        """Successful optimizer steps taken (saved in checkpoints)."""
        self.skips = SkipCounter(self.config.muon_max_consecutive_skipped_steps)
        """Steps skipped for non-finite gradients (``skips.skipped_steps``, ``skips.consecutive``)."""
        self.step_seconds = 0.0
        """Wall time of the last ``step()`` on this rank."""
        self.measure_updates = False
        """Set (on every rank) before a step whose update RMS :meth:`log_statistics` will
        report; left off, a step spends nothing on it."""

    @property
    def muon_optimizers(self) -> List[MuonDistributedOptimizer]:
        return [o for o in self.chained_optimizers if isinstance(o, MuonDistributedOptimizer)]

    @property
    def dense(self) -> MuonDistributedOptimizer:
        return next(o for o in self.muon_optimizers if o.name == "dense")

    @property
    def expert(self) -> Optional[MuonDistributedOptimizer]:
        return next((o for o in self.muon_optimizers if o.name == "expert"), None)

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
        """Megatron's pre-step hook: every chained optimizer's reduced gradients copied into
        its fp32 masters (its storage backend), unscaled and checked for inf/NaN; True (skip
        the step on every rank) when any is not finite. Megatron does this only with a loss
        scaler; we do it always (a unit scale without one), so bf16 and fp32 runs skip
        non-finite steps too. One fused kernel unscales and flags (Megatron's); each flag is
        MAX-reduced over its optimizer's grad-statistics group, so every rank decides alike.
        Every loss scaler is then updated with the combined flag, so the dense and expert
        optimizers skip together and their scales stay equal (Megatron's chain would update
        each scaler with its own optimizer's flag)."""
        flags = []
        for opt in self.muon_optimizers:
            with megatron_timer(opt.config, "optimizer-copy-to-main-grad"):
                grads = [] if opt.is_stub_optimizer else opt.storage.copy_grads_to_masters()
            with megatron_timer(opt.config, "optimizer-unscale-and-check-inf"):
                inv_scale = opt.grad_scaler.inv_scale if opt.grad_scaler else opt._scale_one
                device = grads[0].device if grads else inv_scale.device
                found = torch.zeros(1, dtype=torch.float, device=device)
                if grads:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
                group = opt.get_grad_stats_parallel_group()
                if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
                flags.append(found)
        found = bool(torch.cat(flags).max().item() > 0)
        for opt in self.muon_optimizers:
            if opt.grad_scaler:
                opt.grad_scaler.update(found)
        return found

    @torch.no_grad()
    def step(self):
        """Megatron's chained step (``ChainedOptimizer.step``): :meth:`prepare_grads` (copy
        the grads into the fp32 masters, unscale, check for inf/NaN in every precision and
        update the loss scalers; a non-finite step returns ``(False, None, None)`` on every
        rank with all state untouched), Megatron's grad norm, clipping,
        ``grad_norm_skip_threshold`` and zero counting, then :meth:`step_with_ready_grads`.

        Then the skip bookkeeping: the ``muon_max_consecutive_skipped_steps``-th
        non-finite step in a row raises :class:`~megatron_muon.non_finite.NonFiniteGradientError`
        on every rank."""
        start = time.perf_counter()
        self.finish_pending_step()  # a unit the last forward never synced
        try:
            result = super().step()
        finally:
            # A skipped step (inf/nan) starts the next one with fresh max-logit recorders too.
            if self.qk_clip is not None:
                self.qk_clip.reset()
        self.step_seconds = time.perf_counter() - start
        if result[0]:
            self.num_steps += 1
        skipped = not result[0] and result[1] is None  # (False, norm, ..) is Megatron's grad-norm skip
        counts = skipped and not any(opt.loss_scaler_can_back_off() for opt in self.muon_optimizers)
        if self.skips.record(skipped, counts):
            raise self._non_finite_error()
        return result

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The update of the chained optimizers (dense first): this step's Muon work begun
        (``pipeline.StepWork``), AdamW on the scalar parameters, QK-Clip's row factors, then
        the schedule (:attr:`schedule`) runs the Muon step: :class:`~megatron_muon.pipeline.RunNow`
        ('none') every chunk, QK-Clip's scaling, the master -> model copy and the parameter
        sync at once; :class:`~megatron_muon.pipeline.PendingStep` ('forward') every chunk's
        momentum now and the rest before the next forward syncs each parameter. As
        Megatron's chain does with ``overlap_param_gather_with_optimizer_step``, the first
        model chunk's all-gather is then dispatched to overlap the rest of the iteration."""
        optimizers = self.muon_optimizers
        with megatron_timer(self.config, "optimizer-inner-step"):
            work = StepWork(
                [opt.muon for opt in optimizers], [opt.muon_lr_wd() for opt in optimizers], self.measure_updates
            )
            for opt in optimizers:
                with record_function("muon/adamw"):
                    opt.optimizer.step()  # AdamW on the scalar parameters
            clips = []
            for opt in optimizers:
                if opt.qk_clip is not None:
                    with record_function("muon/qk_clip"):
                        clips += [(opt.shard_map, param, factors) for param, factors in opt.qk_clip.clip_factors()]
            self.schedule.run(work, clips)
        self.previous_work, self.work = self.work, work
        if self.config.overlap_param_gather_with_optimizer_step:
            self.dense.storage.dispatch_param_sync()
        return True

    @torch.no_grad()
    def finish_pending_step(self) -> None:
        """Run what ``muon_step_overlap='forward'`` left of the last step for the next
        forward (nothing otherwise): collective over the orthogonalization groups. Anything
        that reads the parameters or the optimizer state before that forward calls it."""
        if self.pending is not None and self.pending.active:
            self.pending.finish_all()

    def prepare_model_params_for_param_sync(self) -> None:
        """Megatron-LM calls this before a forced parameter sync (evaluation, checkpoints,
        the end of training): the pending step first."""
        self.finish_pending_step()
        super().prepare_model_params_for_param_sync()

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
        """Megatron dist-checkpointing state in the storage backend's format
        (``storage.checkpoint_format``): every state tensor in model coordinates (see
        ``megatron_muon.checkpoint``), reshardable across TP/PP/EP/DP and expert layouts."""
        return self.dense.storage.sharded_state_dict(self, model_sharded_state_dict, is_loading, kwargs.get("metadata"))

    def state_dict(self):
        raise NotImplementedError(
            "megatron_muon saves optimizer state only as a distributed checkpoint (torch_dist): use "
            "sharded_state_dict() (Megatron-LM: --ckpt-format torch_dist) or megatron_muon.checkpoint.save_checkpoint."
        )

    def load_state_dict(self, state_dict):
        """Load what the checkpoint returned for :meth:`sharded_state_dict`."""
        self.finish_pending_step()  # or it would land on the loaded state
        self.dense.storage.load_state_dict(self, state_dict)

    def plan_statistics(self) -> List[Dict[str, object]]:
        return [o.plan_statistics() for o in self.muon_optimizers]

    @torch.no_grad()
    def log_statistics(self) -> Dict[str, float]:
        """The numbers a Muon run watches, for the last step; collective over every rank.

        ``update-rms``: RMS of all Muon updates (orthogonalized and scaled, before the
        learning rate; each matrix counted once, by its owner) of the last step taken with
        :attr:`measure_updates`; while that step is still pending (``muon_step_overlap``
        'forward'), of the step before it, which the forward has finished: measuring never
        finishes a pending step. ``skipped-steps``: steps skipped for non-finite gradients
        so far. ``optimizer-step-ms``: this rank's ``step()`` (with a pending step, only the
        part it ran). With QK-Clip or ``log_max_attention_logit``: ``max-attention-logit``
        and ``mean-attention-logit`` (the mean over layers of each layer's largest logit)
        and ``qk-clip-heads-clipped``."""
        out = {"skipped-steps": float(self.skips.skipped_steps), "optimizer-step-ms": self.step_seconds * 1e3}
        pending = self.pending is not None and self.pending.active
        work = self.previous_work if pending else self.work
        measured = work.measured() if work is not None else None
        if measured is not None:
            device = self.dense.muon.device or torch.device("cpu")
            sums = torch.zeros(2, dtype=torch.float64, device=device)
            square_sum, numel = measured
            if square_sum is not None:
                sums[0] += square_sum.double().to(device)
            sums[1] += numel
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(sums)
            out["update-rms"] = float((sums[0] / sums[1].clamp_min(1)).sqrt())
        clip = self.qk_clip
        if clip is not None:
            local = (clip.layer_maxima(), clip.heads_clipped)
            gathered = [local]
            if clip.mp_group is not None and clip.mp_group.size() > 1:
                gathered = [None] * clip.mp_group.size()
                dist.all_gather_object(gathered, local, group=clip.mp_group)
            layers: Dict[Tuple[str, int], float] = {}
            for maxima, _ in gathered:
                for number, value in maxima.items():
                    layers[number] = max(value, layers.get(number, value))
            if layers:
                out["max-attention-logit"] = max(layers.values())
                out["mean-attention-logit"] = sum(layers.values()) / len(layers)
            out["qk-clip-heads-clipped"] = float(sum(heads for _, heads in gathered))
        return out
