"""``MuonDistributedOptimizer``: Megatron's DistributedOptimizer, with Muon for the matrices.

Megatron's ``DistributedOptimizer`` already does everything around the update that a
Megatron user relies on: it shards fp32 master weights and optimizer state over the
data-parallel ranks (each rank owns a contiguous range of every DDP bucket), copies the
reduce-scattered gradients into those shards, unscales them and checks for inf/nan
(fp16 loss scaling), computes the global grad norm and clips, counts zeros, and after
the update copies master weights back and all-gathers the parameters. We keep all of
that by subclassing it, and change only the inner update:

* scalar parameters (embeddings, output layer, norms, biases, by default the router)
  step with ``torch.optim.AdamW`` exactly as in Megatron's distributed optimizer;
* Muon parameters update their momentum on the local shard, then the ``MuonPipeline``
  gathers each logical matrix on its owner, orthogonalizes it once and scatters the
  update back, and every rank applies weight decay and learning rate to its shard;
* the inf/nan check runs in every precision, not only with a loss scaler (see
  ``megatron_muon.non_finite``): a step with a non-finite gradient is skipped on every
  rank, and too many in a row raise with the parameter's name.

``get_muon_optimizer`` builds one such optimizer for dense and one for expert-parallel
parameters and chains them, as ``get_megatron_optimizer`` does for Adam.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

from .config import MuonConfig, update_scale
from .matrices import MuonParam, unwrap
from .non_finite import NonFiniteGradientError, SkipCounter, agreed_culprit, local_non_finite_names, non_finite_flag
from .pipeline import MuonPipeline
from .planner import Plan, build_plan, plan_statistics
from .process_groups import build_ortho_group
from .qk_clip import QKClip
from .offload import OffloadedMomentum
from .variants import SecondMoments, apply_update_

logger = logging.getLogger(__name__)


class MuonAdamW(torch.optim.AdamW):
    """The inner optimizer Megatron's DistributedOptimizer drives: AdamW for groups without
    ``group['muon']``, and a Muon callback (installed by ``MuonDistributedOptimizer`` once
    the shards exist) for the groups with it."""

    def __init__(self, param_groups: List[dict], config: MuonConfig) -> None:
        super().__init__(
            param_groups,
            lr=config.lr if config.lr is not None else 1e-3,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.muon_step: Optional[Callable[[List[dict]], None]] = None
        self._stepped_early = False

    @torch.no_grad()
    def step_early(self) -> None:
        """Take this step now; the next ``step()`` call (from Megatron's
        ``step_with_ready_grads``) then only marks it done. Used to run the expert step
        inside the dense pipeline, while its first gather is in flight."""
        self.step()
        self._stepped_early = True

    @torch.no_grad()
    def step(self, closure=None):
        if self._stepped_early:
            self._stepped_early = False
            return
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon", False)]
        try:
            super().step()
        finally:
            self.param_groups = groups
        if self.muon_step is None:
            raise RuntimeError("MuonAdamW.step() called before MuonDistributedOptimizer installed the Muon step")
        self.muon_step([g for g in groups if g.get("muon", False)])


def init_state(opt: MuonAdamW, config=None) -> None:
    """Allocate optimizer state (for loading checkpoints into a fresh optimizer)."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                if group.get("muon", False):
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                else:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)


def dp_shard_ranges(buffer) -> Dict[torch.nn.Parameter, List[Tuple[int, int]]]:
    """For every param of a DDP buffer, the flat range of it that each DP rank owns.

    Uses Megatron's own range computation, evaluated for every rank rather than only
    this one, so every rank knows where every piece lives.
    """
    size = buffer.data_parallel_group.size()
    out: Dict[torch.nn.Parameter, List[Tuple[int, int]]] = {}
    for bucket in buffer.buckets:
        per_rank = bucket.grad_data.numel() // size
        bucket_params = {p: buffer.param_index_map[p] for p in bucket.params}
        for r in range(size):
            world = Range(bucket.offset + r * per_rank, bucket.offset + (r + 1) * per_rank)
            ranges = DistributedOptimizer._build_model_gbuf_param_range_map(bucket_params, world, bucket.offset)
            for p, rng in ranges.items():
                out.setdefault(p, [(0, 0)] * size)[r] = (rng["param"].start, rng["param"].end)
    for p, ranges in out.items():
        out[p] = [(s, e) if e > s else (0, 0) for s, e in ranges]
    return out


class MuonDistributedOptimizer(DistributedOptimizer):
    """Megatron's distributed optimizer whose matrix parameters are updated by exact,
    distributed Muon. Construct with :func:`get_muon_optimizer`."""

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
        events: Optional[List[Tuple[str, str, int]]] = None,
        qk_clip: Optional[QKClip] = None,
        owner_layout: bool = False,
    ) -> None:
        self.name = name
        self.owner_layout = owner_layout
        """DDP was built with ``muon_param_layout``: owners stay at the DP index holding each matrix."""
        self.qk_clip = qk_clip
        self.events = events if events is not None else []
        self.while_first_gather_in_flight: Optional[Callable[[], None]] = None
        """Work to run after the first gathers are launched (set by the chained optimizer)."""
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
        self.plan, self.pipeline = self._build_pipeline(tp_group)
        self._shards = self._muon_shards()
        self.offload: Optional[OffloadedMomentum] = None
        """The CPU pool of the Muon momentum (``muon_cpu_offload``)."""
        if config.muon_cpu_offload:
            self.offload = OffloadedMomentum(self.pipeline, self._shards, self.pipeline.device)
        self.second_moments: Optional[SecondMoments] = None
        """Variance reduction's factored second moments of the matrices this rank owns."""
        if config.muon_variance_reduction is not None:
            storage = torch.device("cpu") if self.offload is not None else None
            self.second_moments = SecondMoments(config.muon_variance_reduction, self.pipeline.device, storage)
            self.pipeline.after_newton_schulz = self.second_moments
        optimizer.muon_step = self._muon_step

    # ------------------------------------------------------------------ construction
    def _build_pipeline(self, tp_group: dist.ProcessGroup) -> Tuple[Plan, MuonPipeline]:
        cfg: MuonConfig = self.config
        dp_group = self.buffers[0].data_parallel_group if self.buffers else self.data_parallel_group
        group = build_ortho_group(tp_group, dp_group)
        ranges: Dict[torch.nn.Parameter, List[Tuple[int, int]]] = {}
        for buffer in self.buffers:
            ranges.update(dp_shard_ranges(buffer))
        dp_ranges = {}
        for i, mp in enumerate(self.muon_params):
            if mp.param not in ranges:
                raise ValueError(
                    f"Muon parameter {mp.name} is not in any DDP buffer given to this optimizer; "
                    "wrap every model chunk in megatron.core.distributed.DistributedDataParallel "
                    "before building the optimizer."
                )
            dp_ranges[i] = ranges[mp.param]
        plan = build_plan(
            self.muon_params, dp_ranges, group, cfg.muon_tp_mode, cfg.muon_num_ns_steps, cfg.muon_chunk_numel,
            holders_only=self.owner_layout,
            ns_method=cfg.muon_ns_method, split_max_ranks=cfg.muon_split_ns_max_ranks,
        )
        self._check_plan_agrees(plan)
        my_dp = group.coords[group.rank][1]
        local_starts = [dp_ranges[i][my_dp][0] for i in range(len(self.muon_params))]
        scales = [update_scale(cfg, *job.matrix.scale_shape) for job in plan.jobs]
        device = self.muon_params[0].param.device if self.muon_params else None
        pipeline = MuonPipeline(
            plan,
            local_starts,
            scales,
            cfg.muon_num_ns_steps,
            cfg.muon_coefficient_type,
            cfg.muon_ns_dtype,
            cfg.comm_dtype,
            cfg.muon_max_inflight_chunks,
            device,
            name=self.name,
            events=self.events,
            ns_method=cfg.muon_ns_method,
            compiled=cfg.muon_use_torch_compile,
        )
        return plan, pipeline

    def _check_plan_agrees(self, plan: Plan) -> None:
        """Every rank of the group must have derived the same plan (same model structure)."""
        g = plan.group
        if g.size == 1:
            return
        prints = [None] * g.size
        dist.all_gather_object(prints, plan.fingerprint(), group=g.group)
        if len(set(prints)) != 1:
            raise RuntimeError(
                f"Ranks of the {self.name} orthogonalization group derived different Muon plans: the "
                "model chunks differ in structure between tensor/data-parallel ranks. Build the same "
                "model on every rank."
            )

    def _muon_shards(self) -> List[Optional[torch.Tensor]]:
        """This rank's fp32 main shard of every Muon param (None where it holds nothing)."""
        self._main_of_model = {}
        for models, mains in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            self._main_of_model.update({id(m): s for m, s in zip(models, mains)})
        for models, mains in zip(self.model_fp32_groups, self.shard_fp32_groups):
            self._main_of_model.update({id(m): s for m, s in zip(models, mains)})
        return [self._main_of_model.get(id(mp.param)) for mp in self.muon_params]

    def shard_of(self, param: torch.nn.Parameter) -> Optional[Tuple[torch.Tensor, int, int]]:
        """This rank's fp32 master shard of any model param, with its flat range."""
        main = self._main_of_model.get(id(param))
        if main is None:
            return None
        rng = self._get_model_param_range_map(param)["param"]
        return main, rng.start, rng.end

    # ------------------------------------------------------------------ non-finite gradients
    @torch.no_grad()
    def unscale_and_check_grads(self) -> torch.Tensor:
        """Copy the model grads into this rank's main-grad shards, unscale them (loss scaler)
        and return the non-finite flag, all-reduced over the grad-statistics group.

        Megatron's ``prepare_grads`` does this only with a loss scaler; we do it always
        (unit scale without one), so bf16 and fp32 runs skip non-finite steps too."""
        stub = getattr(self, "is_stub_optimizer", False)  # holds no params, still votes
        with self._timer("optimizer-copy-to-main-grad"):
            if not stub:
                self._copy_model_grads_to_main_grads()
        with self._timer("optimizer-unscale-and-check-inf"):
            inv_scale = self.grad_scaler.inv_scale if self.grad_scaler else self._scale_one
            grads = [] if stub else self._collect_main_grad_data_for_unscaling()
            return non_finite_flag(grads, inv_scale, self.get_grad_stats_parallel_group())

    @contextlib.contextmanager
    def _timer(self, name: str):
        """Megatron's timer of the same name (Megatron-LM logs it), when timers are set."""
        timers = self.config.timers
        if timers is None:
            yield
            return
        timers(name, log_level=1).start(barrier=self.config.barrier_with_L1_time)
        try:
            yield
        finally:
            timers(name).stop()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Megatron's pre-step hook: True (skip the step) when any rank's gradient is non-finite."""
        found = bool(self.unscale_and_check_grads().item() > 0)
        if self.grad_scaler:
            self.grad_scaler.update(found)
        return found

    def non_finite_grad_names(self) -> List[str]:
        """Names of the model params whose main-grad shard on this rank is non-finite."""
        names = {}
        for i, chunk in enumerate(self.model_chunks):
            prefix = f"chunk{i}." if len(self.model_chunks) > 1 else ""
            names.update({id(p): prefix + n for n, p in unwrap(chunk).named_parameters()})
        pairs = []
        for models, mains in list(zip(self.model_float16_groups, self.shard_fp32_from_float16_groups)) + list(
            zip(self.model_fp32_groups, self.shard_fp32_groups)
        ):
            pairs += [(names.get(id(m), "<unnamed>"), s.grad) for m, s in zip(models, mains)]
        return local_non_finite_names(pairs)

    def loss_scaler_can_back_off(self) -> bool:
        """True while a dynamic loss scaler can still lower its scale (fp16): its skips are
        its normal work, not a sign that training is broken."""
        scaler = self.grad_scaler
        return scaler is not None and hasattr(scaler, "min_scale") and bool(scaler.scale > scaler.min_scale)

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """Megatron's version skips buckets tagged ``is_managed_by_layer_wise_optimizer``
        (they belong to its LayerWise optimizer); ours tags its owner-aligned Muon buffers the
        same way and updates them itself, so every bucket group is synced here."""
        for model_chunk in self.model_chunks:
            for bucket_group in model_chunk.bucket_groups + model_chunk.expert_parallel_bucket_groups:
                if bucket_group.buckets:
                    model_chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    # ------------------------------------------------------------------ the Muon step
    @torch.no_grad()
    def _muon_step(self, groups: List[dict]) -> None:
        cfg: MuonConfig = self.config
        mu = cfg.muon_momentum
        hyper = {}
        for group in groups:
            for p in group["params"]:
                hyper[id(p)] = (group["lr"], group["weight_decay"])
        if self.offload is not None:
            self.offload.adopt(self.optimizer.state, self._shards)
        mains, grads, bufs, steps = [], [], [], []
        for main in self._shards:
            if main is None or main.grad is None:
                continue
            state = self.optimizer.state[main]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(main, dtype=torch.float32)
                state["step"] = torch.tensor(0.0)
            mains.append(main)
            grads.append(main.grad)
            bufs.append(state["momentum_buffer"])
            steps.append(state["step"])
        if steps:
            torch._foreach_add_(steps, 1.0)
        if self.offload is not None:
            # The momentum stays in the CPU pool: each chunk updates its own ranges on the
            # device as the pipeline launches it.
            inputs = self.offload.begin([m.grad if m is not None else None for m in self._shards], mu, cfg.muon_nesterov)
        else:
            if bufs:
                torch._foreach_mul_(bufs, mu)
                torch._foreach_add_(bufs, grads)
                inputs_list = torch._foreach_add(grads, bufs, alpha=mu) if cfg.muon_nesterov else bufs
            else:
                inputs_list = []
            by_main = {id(m): x for m, x in zip(mains, inputs_list)}
            inputs = [by_main.get(id(m)) if m is not None else None for m in self._shards]

        cautious = cfg.muon_cautious_weight_decay
        for main in mains:
            lr, wd = hyper[id(main)]
            if wd != 0.0 and not cautious:  # cautious decay needs the update: in apply
                main.mul_(1.0 - lr * wd)

        shards = self._shards

        def apply(param_index: int, start: int, end: int, update: torch.Tensor) -> None:
            main = shards[param_index]
            lr, wd = hyper[id(main)]
            apply_update_(main[start:end], update, lr, wd, cautious)

        try:
            self.pipeline.run(inputs, apply, self.while_first_gather_in_flight)
        finally:
            if self.offload is not None:
                self.offload.finish()
        if self.qk_clip is not None:
            self.qk_clip.apply(self.shard_of)

    # ------------------------------------------------------------------ introspection
    @property
    def trace(self) -> List[Tuple[str, str, int]]:
        """Stage events of the last step, in order: (pipeline, stage, chunk index)."""
        return list(self.events)

    @property
    def traffic(self) -> Dict[str, int]:
        """Bytes this rank sent in the Muon all-to-alls since the last ``reset_traffic``."""
        return dict(self.pipeline.traffic)

    def reset_traffic(self) -> None:
        self.pipeline.traffic.clear()

    def plan_statistics(self) -> Dict[str, object]:
        return plan_statistics(self.plan)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """Everything this rank needs to resume at the same parallel layout: the inner
        optimizer state (momentum, AdamW moments, steps) of its shards, its fp32 master
        shards, the grad scaler, and a fingerprint of the plan to refuse other layouts."""
        state = {
            "inner": self.optimizer.state_dict(),
            "master": [[t.detach().clone() for t in group] for group in self.shard_fp32_from_float16_groups],
            "plan": self.plan.fingerprint(),
            "kind": "megatron_muon.MuonDistributedOptimizer",
        }
        if self.second_moments is not None:
            state["second_moments"] = {k: v.clone() for k, v in self.second_moments.state.items()}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        if state_dict.get("kind") != "megatron_muon.MuonDistributedOptimizer":
            raise ValueError(
                "This optimizer state was not written by megatron_muon's MuonDistributedOptimizer "
                "(for a Megatron AdamW checkpoint, convert it with tools/convert_checkpoint.py adam-to-muon)."
            )
        if state_dict["plan"] != self.plan.fingerprint():
            raise ValueError(
                "The optimizer state was saved with a different parallel layout or model; "
                "state_dict()/load_state_dict() resume only at the same layout. Use the "
                "distributed checkpoint (sharded_state_dict) to change layouts."
            )
        self.optimizer.load_state_dict(state_dict["inner"])
        for group, saved in zip(self.shard_fp32_from_float16_groups, state_dict["master"]):
            for tensor, value in zip(group, saved):
                tensor.copy_(value)
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._shards = self._muon_shards()
        if self.second_moments is not None:
            saved = state_dict.get("second_moments", {})
            self.second_moments.state = {k: v.to(self.second_moments.storage) for k, v in saved.items()}
        self.state_loaded()

    def state_loaded(self) -> None:
        """After any load: move the loaded momentum into the CPU pool (``muon_cpu_offload``),
        so that no Muon optimizer state stays on the device between steps."""
        if self.offload is not None:
            self.offload.adopt(self.optimizer.state, self._shards)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        raise NotImplementedError(
            "Call sharded_state_dict() on the MuonChainedOptimizer that get_muon_optimizer "
            "returned: the dense and expert optimizers are saved together, in model coordinates."
        )

    def common_state(self) -> Dict[str, object]:
        """Non-tensor state for checkpoints: grad scaler and the parameter groups'
        settings (what Megatron's AdamW needs if the checkpoint is converted back)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None, "param_groups": groups}

    def load_common_state(self, common: Dict[str, object]) -> None:
        if self.grad_scaler and common.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(common["grad_scaler"])


class MuonChainedOptimizer(ChainedOptimizer):
    """Megatron's ChainedOptimizer over our dense and expert optimizers, with our extras.

    With ``muon_overlap_expert_ns`` the expert optimizer's step (its stacked per-expert
    Newton–Schulz) runs inside the dense pipeline, after the dense pipeline has launched
    its first gathers and before it waits for them, so that communication is hidden
    behind expert compute.
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
        """Megatron's chained step; a step with non-finite gradients returns
        ``(False, None, None)`` on every rank with all state untouched, and the
        ``muon_max_consecutive_skipped_steps``-th such step in a row raises
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

    def _step(self) -> bool:
        self.events.clear()
        by_name = {o.name: o for o in self.muon_optimizers}
        dense, expert = by_name.get("dense"), by_name.get("expert")
        overlap = dense is not None and expert is not None and self.config.muon_overlap_expert_ns
        if not overlap:
            return super()._step()
        dense.while_first_gather_in_flight = expert.optimizer.step_early
        try:
            return super()._step()
        finally:
            dense.while_first_gather_in_flight = None

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
