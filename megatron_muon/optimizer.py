"""The Muon optimizer: Megatron's distributed optimizer with exact, distributed Muon for the
matrices, dense and expert-parallel parameters chained as ``get_megatron_optimizer`` does.

Megatron's ``DistributedOptimizer`` already does everything around the update that a
Megatron user relies on: fp32 master weights and optimizer state sharded over the
data-parallel ranks, the copy of the reduce-scattered gradients into the masters, loss
scaling, the global grad norm and clipping, the master -> model copy and the parameter
all-gather. :class:`MuonDistributedOptimizer` subclasses it (one for dense, one for
expert-parallel parameters) and :class:`MuonChainedOptimizer` subclasses Megatron's
``ChainedOptimizer``, keeping its ``step()``. Where the masters, gradients and parameters
live is the data-parallel engine's: each optimizer holds a storage backend
(``storage/``) and asks it for the copies, the parameter sync and the checkpoint format.
The update itself is :meth:`MuonChainedOptimizer.step_with_ready_grads`:

1. every Muon chunk of both optimizers through ``pipeline.drive`` (momentum, gather,
   Newton–Schulz, scatter, decay and update; the expert chunks while the first dense
   gathers travel);
2. AdamW on the scalar parameters (embeddings, output layer, norms, biases, the router);
3. QK-Clip on the fp32 masters;
4. the backend's master -> model copy and parameter sync.

With ``muon_step_overlap='forward'`` the chunks' exchanges, QK-Clip's scaling and the copy
wait in a :class:`~megatron_muon.step_overlap.PendingStep` until the next forward's
parameter sync needs them (``step_overlap.py``).

Before it, ``prepare_grads`` checks for inf/NaN in every precision (``non_finite.py``): a
step with a non-finite gradient is skipped on every rank, and too many in a row raise.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.profiler import record_function

from .config import MuonConfig, update_scale
from .matrices import MuonParam, unwrap
from .newton_schulz import method_for_device, resolve_coefficients
from .non_finite import NonFiniteGradientError, SkipCounter, agreed_culprit, local_non_finite_names, non_finite_flag
from .pipeline import MuonStep, advance_momentum, chunk_exchange, chunk_update, drive
from .planner import Plan, plan_for_config, plan_statistics, rank_messages
from .process_groups import build_ortho_group, subgroup
from .qk_clip import QKClip
from .state import OffloadedMasters, OwnerStates, ShardStates, init_adam_states, muon_states
from .step_overlap import PendingStep, side_stream
from .storage import StorageBackend, storage_for
from .timers import megatron_timer

logger = logging.getLogger(__name__)


class MuonAdamW(torch.optim.AdamW):
    """The inner torch optimizer Megatron's DistributedOptimizer holds.

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


class MuonDistributedOptimizer(DistributedOptimizer):
    """Megatron's distributed optimizer whose matrix parameters are updated by exact,
    distributed Muon, for one kind of parameters (dense or expert-parallel). Construct with
    :func:`~megatron_muon.get_muon_optimizer`."""

    def __init__(
        self,
        optimizer: MuonAdamW,
        config: MuonConfig,
        grad_scaler,
        model_chunks: List[torch.nn.Module],
        per_model_buffers: Dict[int, list],
        data_parallel_group: dist.ProcessGroup,
        data_parallel_group_gloo: Optional[dist.ProcessGroup],
        data_parallel_group_idx: int,
        tp_group: dist.ProcessGroup,
        muon_params: Sequence[MuonParam],
        name: str = "dense",
        qk_clip: Optional[QKClip] = None,
        owner_aligned: bool = False,
        storage: Optional[Type[StorageBackend]] = None,
    ) -> None:
        self.name = name
        self.qk_clip = qk_clip
        self.owner_aligned = owner_aligned
        """DDP was built with ``owner_aligned_param_layout``: owners stay at the DP index holding each matrix."""
        super().__init__(
            optimizer,
            config,
            grad_scaler,
            init_state,
            model_chunks,
            per_model_buffers,
            data_parallel_group,
            data_parallel_group_gloo,
            data_parallel_group_idx,
            0,
        )
        self.muon_params = list(muon_params)
        self.muon_param_ids = {id(mp.param) for mp in self.muon_params}
        self.masters_offload: Optional[OffloadedMasters] = None
        """The fp32 masters of the Muon matrices in a CPU pool (``muon_cpu_offload`` with
        Megatron's ``optimizer_cpu_offload``)."""
        self.storage: StorageBackend = (storage or storage_for(model_chunks))(self, data_parallel_group)
        """Where the masters, gradients and parameters live (the data-parallel engine's)."""
        self.shard_map = self.storage.shard_map
        """Who holds which range of every parameter, and this rank's fp32 masters."""
        self.ns_method = method_for_device(
            config.muon_ns_method, self.muon_params[0].param.device if self.muon_params else None
        )
        """The Newton–Schulz iteration on this device (``muon_ns_method`` 'auto' is standard on a CPU)."""
        self.plan = self._plan(tp_group, owner_aligned)
        self.muon = self._muon_step()

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

    def _muon_step(self) -> MuonStep:
        """Everything the Muon step reads: this rank's messages of the plan, masters, state."""
        cfg: MuonConfig = self.config
        shards = [self.shard_map[mp.param] for mp in self.muon_params]
        masters = [s.master for s in shards]
        device = self.muon_params[0].param.device if self.muon_params else None
        messages = rank_messages(
            self.plan, [s.start for s in shards], [m.numel() if m is not None else None for m in masters]
        )
        if cfg.optimizer_cpu_offload:
            self.masters_offload = OffloadedMasters(self.storage.float16_masters(), device)
        me = self.plan.group.rank
        return MuonStep(
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
            scales=[update_scale(cfg, *job.matrix.scale_shape) for job in self.plan.jobs],
            momentum=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            ns_steps=cfg.muon_num_ns_steps,
            coefficients=cfg.muon_coefficient_type,
            ns_dtype=cfg.muon_ns_dtype,
            ns_method=self.ns_method,
            compiled=cfg.muon_use_torch_compile,
            schedule=resolve_coefficients(cfg.muon_coefficient_type).schedule(cfg.muon_num_ns_steps),
            comm_dtype=cfg.comm_dtype,
            variance_reduction=cfg.muon_variance_reduction,
            cautious=cfg.muon_cautious_weight_decay,
            device=device,
            subgroups={
                tuple(sorted(j.ns_ranks)): subgroup(self.plan.group, j.ns_ranks)
                for j in self.plan.jobs
                if me in j.ns_ranks
            },
            offloaded_masters=self.masters_offload,
        )

    def plan_statistics(self) -> Dict[str, object]:
        return plan_statistics(self.plan)

    # ------------------------------------------------------------------ non-finite gradients
    @torch.no_grad()
    def unscale_and_check_grads(self) -> torch.Tensor:
        """Copy the model grads into this rank's master grads, unscale them (loss scaler)
        and return the non-finite flag, all-reduced over the grad-statistics group.

        Megatron's ``prepare_grads`` does this only with a loss scaler; we do it always
        (unit scale without one), so bf16 and fp32 runs skip non-finite steps too."""
        stub = getattr(self, "is_stub_optimizer", False)  # holds no params, still votes
        with megatron_timer(self.config, "optimizer-copy-to-main-grad"):
            if not stub:
                self.storage.copy_grads_to_masters()
        with megatron_timer(self.config, "optimizer-unscale-and-check-inf"):
            inv_scale = self.grad_scaler.inv_scale if self.grad_scaler else self._scale_one
            grads = [] if stub else self.storage.master_grads()
            return non_finite_flag(grads, inv_scale, self.get_grad_stats_parallel_group())

    def _copy_main_params_to_model_params(self) -> None:
        self.storage.copy_masters_to_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.storage.release_master_grads()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Megatron's pre-step hook: True (skip the step) when any rank's gradient is non-finite."""
        found = bool(self.unscale_and_check_grads().item() > 0)
        if self.grad_scaler:
            self.grad_scaler.update(found)
        return found

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
    def muon_chunks(self, measure_updates: bool = False) -> List[Iterator[None]]:
        """This step's Muon chunks, each a generator for ``pipeline.drive`` (the state of
        the step is started here; :meth:`end_muon_step` ends it); ``measure_updates``: sum
        the squares of the updates (the update RMS)."""
        per_param = self._begin_muon_step(measure_updates)
        kept: dict = {}
        return [chunk_update(self.muon, msg, per_param, kept) for msg in self.muon.messages]

    def pending_muon_chunks(self, measure_updates: bool = False) -> Tuple[List[Iterator[None]], List[torch.Tensor]]:
        """This step's Muon chunks with every chunk's momentum advanced here, so that the
        generators need no gradient (a pending step): the chunk exchanges, and the tensors
        made here that they read (the orthogonalization inputs)."""
        per_param = self._begin_muon_step(measure_updates)
        kept: dict = {}
        inputs = [advance_momentum(self.muon, msg, kept) for msg in self.muon.messages]
        chunks = [chunk_exchange(self.muon, msg, x, per_param, kept) for msg, x in zip(self.muon.messages, inputs)]
        return chunks, [t for x in inputs for t in x.values()] + list(kept.values())

    def _begin_muon_step(self, measure_updates: bool) -> List[Tuple[float, float]]:
        """Start the step's state; this step's (learning rate, weight decay) of every Muon param."""
        lr_wd = {id(p): (g["lr"], g["weight_decay"]) for g in self.optimizer.muon_groups for p in g["params"]}
        self.muon.shard_states.begin()
        self.muon.previous_updates = self.muon.measured_updates()
        self.muon.measure_updates = measure_updates
        self.muon.update_square_sum, self.muon.update_numel = None, 0
        return [lr_wd[id(m)] if m is not None else (0.0, 0.0) for m in self.muon.masters]

    def end_muon_step(self) -> None:
        self.muon.shard_states.finish()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """This optimizer's update when it steps alone (Megatron's ``step()`` calls this
        after preparing and clipping the gradients): the chain's :func:`update`."""
        if self.qk_clip is not None:
            raise NotImplementedError(
                "With QK-Clip, step the MuonChainedOptimizer that get_muon_optimizer returned: its step() "
                "resets the max-logit recorders after every step, taken or skipped."
            )
        update([self], overlap_expert=False)
        return True

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

    def common_state(self) -> Dict[str, object]:
        """Non-tensor state for checkpoints: the grad scaler and the parameter groups'
        settings (what Megatron's AdamW needs if the checkpoint is converted back)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None, "param_groups": groups}

    def load_common_state(self, common: Dict[str, object]) -> None:
        if self.grad_scaler and common.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(common["grad_scaler"])


def update(
    optimizers: Sequence[MuonDistributedOptimizer],
    overlap_expert: bool,
    measure_updates: bool = False,
    pending: Optional[PendingStep] = None,
) -> None:
    """The update of chained Muon optimizers (dense first), in the order the data flows:
    every Muon chunk (the expert chunks while the first dense gathers travel, with
    ``overlap_expert``), AdamW, QK-Clip, the master -> model copy, the parameter sync.

    With ``pending`` (``muon_step_overlap='forward'``): the momentum of every chunk, AdamW
    and QK-Clip's row factors; the chunks' exchanges, the scaling and the copy are left to
    ``pending``, which the next forward's parameter sync drives."""
    config = optimizers[0].config
    with megatron_timer(config, "optimizer-inner-step"):
        if pending is None:
            chunks = [opt.muon_chunks(measure_updates) for opt in optimizers]
            if overlap_expert and len(chunks) > 1:
                drive(chunks[0], config.muon_max_inflight_chunks, overlapped=chunks[1])
            else:
                for chunk_list in chunks:
                    drive(chunk_list, config.muon_max_inflight_chunks)
            for opt in optimizers:
                opt.end_muon_step()
        else:
            made = [opt.pending_muon_chunks(measure_updates) for opt in optimizers]
            chunks, inputs = [c for c, _ in made], [t for _, ts in made for t in ts]
        for opt in optimizers:
            with record_function("muon/adamw"):
                opt.optimizer.step()  # AdamW on the scalar parameters
        clips = []
        for opt in optimizers:
            if opt.qk_clip is not None:
                with record_function("muon/qk_clip"):
                    if pending is None:
                        opt.qk_clip.apply(opt.shard_map)
                    else:
                        clips += opt.qk_clip.clip_factors()
    if pending is not None:
        pending.begin(chunks, clips, inputs)
        return
    with megatron_timer(config, "optimizer-copy-main-to-model-params"), record_function("muon/copy_to_model"):
        for opt in optimizers:
            opt.storage.copy_masters_to_model()
    for opt in optimizers:
        opt.storage.start_param_sync()


class MuonChainedOptimizer(ChainedOptimizer):
    """Megatron's ChainedOptimizer over our dense and expert optimizers.

    ``step()`` is Megatron's: :meth:`prepare_grads` (ours), the grad norm over both
    optimizers, clipping and zero counting, then :meth:`step_with_ready_grads`. With
    ``muon_step_overlap='forward'`` part of the update is left in :attr:`pending` for the
    next forward; :meth:`finish_pending_step` runs it at once."""

    def __init__(self, chained_optimizers, step_overlap: str = "none") -> None:
        super().__init__(chained_optimizers)
        self.pending: Optional[PendingStep] = None
        if step_overlap == "forward":
            self.pending = PendingStep(self.muon_optimizers, side_stream(self.config, self.dense.muon.device))
        """With ``muon_step_overlap='forward'``: what the last step left for the next forward."""
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
        """The update of both optimizers (:func:`update`); then, as Megatron's chain does
        with ``overlap_param_gather_with_optimizer_step``, the first model chunk's
        all-gather is dispatched to overlap the rest of the iteration."""
        update(self.muon_optimizers, self.config.muon_overlap_expert_ns, self.measure_updates, self.pending)
        if self.config.overlap_param_gather_with_optimizer_step:
            self.dense.model_chunks[0].start_param_sync(force_dispatch=True)
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
        measured = [
            opt.muon.previous_updates if pending else opt.muon.measured_updates() for opt in self.muon_optimizers
        ]
        if all(m is not None for m in measured):
            device = self.dense.muon.device or torch.device("cpu")
            sums = torch.zeros(2, dtype=torch.float64, device=device)
            for square_sum, numel in measured:
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
