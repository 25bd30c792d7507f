"""``MuonDistributedOptimizer``: Megatron's DistributedOptimizer, with Muon for the matrices.

Megatron's ``DistributedOptimizer`` already does everything around the update that a
Megatron user relies on: it shards fp32 master weights and optimizer state over the
data-parallel ranks (each rank owns a contiguous range of every DDP bucket), copies the
reduce-scattered gradients into those shards, unscales them and checks for inf/nan
(fp16 loss scaling), computes the global grad norm and clips, counts zeros, and after
the update copies master weights back and all-gathers the parameters. We keep all of
that by subclassing it, and change the update itself (``step_with_ready_grads``, the
level Megatron's own ``LayerWiseDistributedOptimizer`` overrides):

* Muon parameters update their momentum on the local shard, then the ``MuonPipeline``
  gathers each logical matrix on its owner, orthogonalizes it once and scatters the
  update back, and every rank applies weight decay and learning rate to its shard;
* scalar parameters (embeddings, output layer, norms, biases, by default the router)
  step with ``torch.optim.AdamW`` exactly as in Megatron's distributed optimizer;
* QK-Clip rescales the query/key rows of the fp32 masters;
* the inf/nan check runs in every precision, not only with a loss scaler (see
  ``megatron_muon.non_finite``): a step with a non-finite gradient is skipped on every
  rank, and too many in a row raise with the parameter's name.

``get_muon_optimizer`` builds one such optimizer for dense and one for expert-parallel
parameters and chains them (``chained_optimizer.py``), as ``get_megatron_optimizer`` does
for Adam; :meth:`MuonChainedOptimizer.step_with_ready_grads` is the whole update of both,
in the order the data flows.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from .config import MuonConfig, update_scale
from .dp_ranges import dp_shard_ranges
from .matrices import MuonParam, unwrap
from .non_finite import local_non_finite_names, non_finite_flag
from .pipeline import MuonPipeline, PipelineRun
from .planner import Plan, build_plan, plan_statistics
from .process_groups import build_ortho_group
from .qk_clip import QKClip
from .split_newton_schulz import SplitCost
from .offload import OffloadedMasters, OffloadedMomentum
from .variants import SecondMoments, apply_update_

logger = logging.getLogger(__name__)


class MuonAdamW(torch.optim.AdamW):
    """The inner torch optimizer Megatron's DistributedOptimizer holds.

    It holds every parameter group, so Megatron's learning-rate scheduler, ``state_dict``
    and checkpoints see them all; a group flagged ``group['muon']`` keeps the Muon state of
    its fp32 master shards (``momentum_buffer``, ``step``), which
    :class:`MuonDistributedOptimizer` updates through its pipeline. ``step()`` is AdamW
    over the other (scalar) groups only."""

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


@contextlib.contextmanager
def megatron_timer(config, name: str) -> Iterator[None]:
    """Megatron's optimizer timer of that name (Megatron-LM logs it), when timers are set."""
    timers = config.timers
    if timers is None:
        yield
        return
    timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        timers(name).stop()


@dataclass
class MuonStepInFlight:
    """A Muon step of one optimizer whose pipeline has launched its first gathers."""

    run: PipelineRun
    shards: List[Optional[torch.Tensor]]
    """This rank's fp32 master shard of every Muon param (None where it holds nothing)."""
    lr_wd: Dict[int, Tuple[float, float]]
    """id(master shard) -> (learning rate, weight decay) of its group this step."""
    cautious: bool

    def apply(self, param_index: int, start: int, end: int, update: torch.Tensor) -> None:
        """One arriving update piece onto its master shard range (lr, and cautious decay)."""
        main = self.shards[param_index]
        lr, wd = self.lr_wd[id(main)]
        apply_update_(main[start:end], update, lr, wd, self.cautious)


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
        self.offloaded_masters: Optional[OffloadedMasters] = None
        """The CPU pool of the Muon matrices' fp32 masters (``muon_cpu_offload`` with
        Megatron's ``optimizer_cpu_offload``)."""
        if config.muon_cpu_offload:
            self.offload = OffloadedMomentum(self.pipeline, self._shards, self.pipeline.device)
            if config.optimizer_cpu_offload:
                self.offloaded_masters = OffloadedMasters(self.float16_muon_masters(), self.pipeline.device)
        self.second_moments: Optional[SecondMoments] = None
        """Variance reduction's factored second moments of the matrices this rank owns."""
        if config.muon_variance_reduction is not None:
            storage = torch.device("cpu") if self.offload is not None else None
            self.second_moments = SecondMoments(config.muon_variance_reduction, self.pipeline.device, storage)
            self.pipeline.after_newton_schulz = self.second_moments

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
            split_cost=self._split_cost(group),
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

    def _split_cost(self, group) -> SplitCost:
        """The price of split Newton–Schulz's bytes (the config's FLOPs per byte), with each
        group rank's node from its global rank and the GPUs per node (``LOCAL_WORLD_SIZE``,
        as torchrun sets it, else the visible GPUs, else 1)."""
        cfg: MuonConfig = self.config
        ranks = dist.get_process_group_ranks(group.group) if group.group is not None else list(range(group.size))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or torch.cuda.device_count() or 1
        return SplitCost(cfg.muon_split_ns_intra_flops_per_byte, cfg.muon_split_ns_inter_flops_per_byte,
                         lambda r: ranks[r] // per_node)

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

    def float16_muon_masters(self) -> List[torch.Tensor]:
        """This rank's fp32 master shards of the bf16/fp16 Muon params (an fp32 param's
        master is a view of the param itself, so it has none of its own)."""
        float16 = {id(m) for group in self.shard_fp32_from_float16_groups for m in group}
        return [m for m in self._shards if m is not None and id(m) in float16]

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
        with megatron_timer(self.config, "optimizer-copy-to-main-grad"):
            if not stub:
                self._copy_model_grads_to_main_grads()
        with megatron_timer(self.config, "optimizer-unscale-and-check-inf"):
            inv_scale = self.grad_scaler.inv_scale if self.grad_scaler else self._scale_one
            grads = [] if stub else self._collect_main_grad_data_for_unscaling()
            return non_finite_flag(grads, inv_scale, self.get_grad_stats_parallel_group())

    def _copy_model_grads_to_main_grads(self) -> None:
        """Megatron's copy of the reduce-scattered grads into the masters' ``.grad``; the
        CPU-offloaded masters take them through their device placeholder."""
        masters = self.offloaded_masters
        with masters.grads_assignable() if masters is not None else contextlib.nullcontext():
            super()._copy_model_grads_to_main_grads()

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
        """All-gather the parameters of the bucket groups this optimizer updates: those
        built from its own buffers (dense or expert-parallel).

        Megatron's version walks every bucket group of every model chunk, skipping only
        those tagged ``is_managed_by_layer_wise_optimizer`` (its LayerWise optimizer's); ours
        tags its owner-aligned Muon buffers the same way and updates them itself, so the tag
        says nothing here. Walking every group would all-gather each one once per chained
        optimizer: twice per step with experts."""
        mine = {id(bucket) for buffer in self.buffers for bucket in buffer.buckets}
        for model_chunk in self.model_chunks:
            for bucket_group in model_chunk.bucket_groups + model_chunk.expert_parallel_bucket_groups:
                if any(id(bucket) in mine for bucket in bucket_group.buckets):
                    model_chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    # ------------------------------------------------------------------ the update, in parts
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """This optimizer's whole update, when it steps alone (Megatron's ``step()`` calls
        this after preparing and clipping the gradients). Under
        :class:`MuonChainedOptimizer` the chain runs the same parts itself, interleaving the
        dense and expert optimizers."""
        with megatron_timer(self.config, "optimizer-inner-step"):
            self.muon_step()
            self.adamw_step()
            self.apply_qk_clip()
        with megatron_timer(self.config, "optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model_params()
        self.start_param_sync()
        return True

    @torch.no_grad()
    def launch_muon_step(self) -> MuonStepInFlight:
        """Start the Muon update of this rank's master shards: momentum (and Nesterov),
        decoupled weight decay, then the pipeline's first chunks' gathers, which are in
        flight when this returns (all-to-all over the orthogonalization group)."""
        cfg: MuonConfig = self.config
        lr_wd = {id(p): (g["lr"], g["weight_decay"]) for g in self.optimizer.muon_groups for p in g["params"]}
        inputs = self._momentum_inputs(cfg.muon_momentum, cfg.muon_nesterov)
        cautious = cfg.muon_cautious_weight_decay
        if not cautious:  # cautious decay needs the update: MuonStepInFlight.apply
            for main in self._shards:
                if main is not None and main.grad is not None:
                    lr, wd = lr_wd[id(main)]
                    if wd != 0.0:
                        main.mul_(1.0 - lr * wd)
        run = self.pipeline.launch_first_gathers(inputs)
        return MuonStepInFlight(run, self._shards, lr_wd, cautious)

    @torch.no_grad()
    def complete_muon_step(self, step: MuonStepInFlight) -> None:
        """The rest of the pipeline: every chunk's Newton–Schulz on its owners and the
        scatter back; each update piece lands on its master shard range as it arrives."""
        try:
            self.pipeline.run_chunks(step.run, step.apply)
        finally:
            if self.offload is not None:
                self.offload.finish()

    def muon_step(self) -> None:
        """The whole Muon update of this optimizer's matrices."""
        self.complete_muon_step(self.launch_muon_step())

    def _momentum_inputs(self, mu: float, nesterov: bool):
        """Advance every held shard's step count and momentum; return the pipeline's inputs
        (per Muon param, this rank's Nesterov momentum shard or None), or, with
        ``muon_cpu_offload``, the offload's per-chunk producer (it updates the momentum of
        each chunk's ranges as the chunk is launched)."""
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
            return self.offload.begin([m.grad if m is not None else None for m in self._shards], mu, nesterov)
        if bufs:
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updated = torch._foreach_add(grads, bufs, alpha=mu) if nesterov else bufs
        else:
            updated = []
        by_main = {id(m): x for m, x in zip(mains, updated)}
        return [by_main.get(id(m)) if m is not None else None for m in self._shards]

    @torch.no_grad()
    def adamw_step(self) -> None:
        """AdamW on this rank's shards of the scalar parameters (the inner optimizer)."""
        self.optimizer.step()

    @torch.no_grad()
    def apply_qk_clip(self) -> None:
        """QK-Clip on the updated fp32 masters (dense optimizer only; all-reduces the
        per-head max logits over DP x CP and the peak over the model-parallel group)."""
        if self.qk_clip is not None:
            self.qk_clip.apply(self.shard_of)

    def start_param_sync(self) -> None:
        """Megatron's parameter all-gather after the update (``DistributedOptimizer.
        step_with_ready_grads``): synchronous here, unless DDP overlaps it with the next
        forward (``overlap_param_gather``)."""
        if self.ddp_config.overlap_param_gather:
            return
        with megatron_timer(self.config, "params-all-gather"):
            self.start_param_sync_for_bucket_group_subset()

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
