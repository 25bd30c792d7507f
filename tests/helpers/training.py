"""Shared by the distributed tests: build a tiny Megatron model with our optimizer, train it
in every rank, train the single-process reference, and compare.

Rank functions here are module-level so that ``run_distributed`` can start them.
"""

from __future__ import annotations

import torch

from megatron_muon.testing import models as M

STEPS, GBS, MBS = 3, 8, 2
BASE_CFG = dict(
    lr=0.02,
    min_lr=0.02,
    weight_decay=0.1,
    clip_grad=1.0,
    muon_momentum=0.9,
    adam_beta1=0.9,
    adam_beta2=0.95,
    muon_ns_dtype=torch.float32,  # muon_comm_dtype None follows it: fp32 end to end
)
# bf16 Newton–Schulz; pieces travel in fp32 so that the comparison measures NS precision,
# not the extra bf16 rounding of the (default) bf16 wire format, which AdamW then amplifies
# into sign flips of near-zero embedding gradients.
BF16_NS = dict(muon_ns_dtype=torch.bfloat16, muon_comm_dtype=torch.float32)
# The Muon momentum and the fp32 masters of a bf16/fp16 model on the CPU (Megatron's offload
# switches, which megatron_muon accepts only together with muon_cpu_offload and fraction 1).
MASTER_OFFLOAD = dict(muon_cpu_offload=True, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)


def muon_config(spec: M.TinyModelSpec, **overrides):
    from megatron_muon import MuonConfig

    cfg = dict(BASE_CFG, bf16=spec.bf16, fp16=spec.fp16)
    cfg["params_dtype"] = torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32
    cfg.update(overrides)
    return MuonConfig(**cfg)


def scheduler(optimizer, cfg):
    """Megatron-LM's constant-lr scheduler (it applies wd_mult: no decay on norms/biases)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )


def build(spec: M.TinyModelSpec, ddp: dict | None = None, fsdp: str | None = None, **cfg_overrides):
    """Model chunks, DDP-wrapped model (Megatron-FSDP with sharding strategy ``fsdp``),
    Muon optimizer and Megatron's scheduler."""
    from megatron_muon import get_muon_optimizer

    chunks = M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=0)
    cfg = muon_config(spec, **cfg_overrides)
    if fsdp is not None:
        model = M.wrap_megatron_fsdp(chunks, chunks[0].config, fsdp, **(ddp or {}))
    else:
        model = M.wrap_ddp(chunks, chunks[0].config, muon_config=cfg, **(ddp or {}))
    opt = get_muon_optimizer(cfg, model)
    return chunks, model, opt, scheduler(opt, cfg)


def train_steps(model, opt, sched, spec: M.TinyModelSpec, batches) -> None:
    """One successful optimizer step per batch, the scheduler stepped after each."""
    for tokens in batches:
        loss, ok = M.train_step(model, opt, tokens, MBS, spec)
        assert ok
        sched.step(1)


def train(spec_kwargs: dict, variants: dict, steps: int = STEPS) -> dict:
    """In every rank: for each named config variant, train ``steps`` steps and report."""
    from megatron.core import parallel_state

    from megatron_muon.testing.traffic import count_collectives

    spec = M.TinyModelSpec(**spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, steps)
    out = {}
    for name, overrides in variants.items():
        chunks, model, opt, sched = build(spec, **overrides)
        losses = []
        with count_collectives() as traffic:
            for tokens in batches:
                loss, ok = M.train_step(model, opt, tokens, MBS, spec)
                assert ok
                sched.step(1)
                losses.append(loss)
        if overrides.get("fsdp"):
            state = M.gather_canonical_state_of_megatron_fsdp(model, spec)
        else:
            for chunk in model:  # with overlap_param_gather the last gather is still pending
                chunk.start_param_sync(force_sync=True)
            state = M.gather_canonical_state(chunks)
        out[name] = dict(
            losses=losses,
            state=state,
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            # The matrices this rank orthogonalizes (leads, when several ranks share one).
            computed=[j.matrix.name for o in opt.muon_optimizers for j in o.plan.jobs if j.owner == o.plan.group.rank],
            stats=[o.plan_statistics() for o in opt.muon_optimizers],
            # The attention layers QK-Clip measures (and clips, with qk_clip) on this rank.
            clip_layers=[layer.name for layer in opt.qk_clip.layers] if opt.qk_clip is not None else [],
            traffic=dict(traffic.bytes),
        )
    return out


def reference(spec_kwargs: dict, variants: dict, steps: int = STEPS) -> dict:
    spec = M.TinyModelSpec(**spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, steps)
    return {
        name: M.reference_train(
            spec, muon_config(spec, **{k: v for k, v in overrides.items() if k not in ("ddp", "fsdp")}), batches, MBS
        )
        for name, overrides in variants.items()
    }


def max_rel_err(full: dict, ref: dict, norm: str = "max") -> tuple:
    """Worst relative error over parameters: elementwise max (``norm='max'``) or Frobenius."""
    worst = (0.0, None)
    for key, value in ref.items():
        diff = full[key] - value
        if norm == "max":
            err = (diff.abs().max() / value.abs().max().clamp_min(1e-12)).item()
        else:
            err = (diff.norm() / value.norm().clamp_min(1e-12)).item()
        worst = max(worst, (err, key), key=lambda x: x[0])
    return worst
