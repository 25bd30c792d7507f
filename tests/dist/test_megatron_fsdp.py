"""Muon on Megatron-FSDP (ZeRO-3), on real Megatron-core GPT models (CPU, gloo): every
sharding strategy against the single-process reference (dense GQA and MLA with QK-Clip,
tensor and context parallelism, MoE experts), a bf16 model against the same run on DDP, and
the checks that refuse what Megatron-FSDP would get wrong."""

from __future__ import annotations

import pytest

from megatron_muon.storage.megatron_fsdp import STRATEGIES
from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import max_rel_err, reference, train

QK = dict(qk_clip=True, qk_clip_threshold=0.04)  # low: heads are clipped at every step
MODELS = {
    "gqa": dict(kind="gqa", extra=QK),
    "mla": dict(kind="mla", extra=QK),
    "moe": dict(kind="moe"),
}
FSDP = {strategy: dict(fsdp=strategy) for strategy in STRATEGIES}


@pytest.fixture(scope="module")
def references():
    return run_distributed(_references, 1, timeout_s=300)[0]


def _references():
    return {kind: reference(spec, {"fp32": {}})["fp32"] for kind, spec in MODELS.items()}


ZERO3 = {"optim_grads_params": FSDP["optim_grads_params"]}
LAYOUTS = [
    # Every strategy where matrices cross both TP and DP pieces, and where experts shard over
    # their own (expert-DP) group; ZeRO-3 (Megatron-LM's default strategy) elsewhere.
    pytest.param("gqa", 4, dict(tp=2), FSDP, id="GQA-DP2xTP2", marks=pytest.mark.slow),
    pytest.param("moe", 4, dict(ep=2), FSDP, id="MoE-EP2xDP2", marks=pytest.mark.slow),
    pytest.param("gqa", 2, {}, ZERO3, id="GQA-DP2"),
    pytest.param("moe", 2, dict(ep=2), ZERO3, id="MoE-EP2", marks=pytest.mark.slow),
    pytest.param("mla", 2, {}, ZERO3, id="MLA-DP2", marks=pytest.mark.slow),
    # Context parallelism: Megatron-FSDP shards over data x context parallel ranks.
    pytest.param("gqa", 4, dict(cp=2), ZERO3, id="GQA-DP2xCP2", marks=pytest.mark.slow),
]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind,world,layout,strategies", LAYOUTS)
def test_every_sharding_strategy_equals_reference(references, kind, world, layout, strategies):
    """Exact Newton–Schulz on whole matrices whose pieces lie in FSDP shards (QK-Clip on the
    sharded fp32 masters): each strategy's weights after 3 steps equal the reference's."""
    results = run_distributed(train, world, MODELS[kind], strategies, timeout_s=450, **layout)
    ref = M.merge_canonical_states([references[kind][1]])
    for strategy in strategies:
        full = M.merge_canonical_states([r[strategy]["state"] for r in results])
        err, key = max_rel_err(full, ref, "fro")
        assert err <= 1e-5, f"{strategy}: {key} differs from the reference by {err:.2e}"
    # Matrices cross FSDP shards, so their pieces travel over the FSDP (data-parallel) group.
    assert any(r["optim_grads_params"]["traffic"].get("all_to_all", 0) > 0 for r in results)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bf16_model_equals_the_distributed_optimizer_run():
    """A bf16 model with fp32 masters (fp32 main gradients): Megatron-FSDP gives the losses
    and weights of the DistributedOptimizer run, which tests/dist/test_mixed_precision_reference.py
    checks step by step against the reference. Not bitwise: 'optim' reduces the accumulated
    gradient once, the others each micro-batch's, so sums differ in the last bit (6e-11 seen);
    bf16 rounding of the weights, AdamW's steps on near-zero gradients and the router's
    top-k choice (which flips on near ties) carry that into the next steps. Measured over
    the three strategies with six kernel sets (an AVX-512/AMX Xeon's own, ATen avx2 and
    default, MKL's and oneDNN's AVX2 paths, oneDNN without AMX): weights at most 1.5e-2
    (the router, a flipped choice, with ATEN_CPU_CAPABILITY=default; 4.5e-3 otherwise),
    losses at most 9.3e-5 (6.8e-5 on an AVX2 AMD EPYC). Over three steps the weights move
    by 15-60 %."""
    spec = dict(MODELS["moe"], bf16=True)  # dense and expert optimizers, EP2 x DP2
    results = run_distributed(train, 4, spec, {"ddp": {}, **FSDP}, timeout_s=350, ep=2)
    ddp = M.merge_canonical_states([r["ddp"]["state"] for r in results])
    for strategy in FSDP:
        full = M.merge_canonical_states([r[strategy]["state"] for r in results])
        err, key = max_rel_err(full, ddp, "fro")
        assert err <= 5e-2, f"{strategy}: {key} differs from the DistributedOptimizer run by {err:.2e}"
        assert results[0][strategy]["losses"] == pytest.approx(results[0]["ddp"]["losses"], rel=1e-3)


def _refusals():
    """Each refused setting's message, built on one rank (EP == DP makes a one-rank group)."""
    import megatron_muon.storage.megatron_fsdp as F
    from megatron_muon import get_muon_optimizer, patching
    from tests.helpers.training import muon_config

    out = {}
    spec = M.TinyModelSpec(kind="gqa")
    cases = {
        "no_shard": ("no_shard", {}, {}),
        "optim without overlap": ("optim", dict(overlap_grad_reduce=False), {}),
        "offload": ("optim_grads_params", {}, dict(muon_cpu_offload=True)),
    }
    chunks = M.build_model_chunks(spec)
    model = M.wrap_megatron_fsdp(chunks, chunks[0].config)
    try:
        get_muon_optimizer(muon_config(spec), model).sharded_state_dict({})
        out["save"] = "saved"
    except NotImplementedError as e:
        out["save"] = str(e)
    for name, (strategy, ddp, cfg) in cases.items():
        chunks = M.build_model_chunks(spec)
        model = M.wrap_megatron_fsdp(chunks, chunks[0].config, strategy, **ddp)
        try:
            get_muon_optimizer(muon_config(spec, **cfg), model)
            out[name] = "built"
        except (ValueError, NotImplementedError) as e:
            out[name] = str(e)
    # Without the fix, a one-rank group's gradient buffer is unsharded: refused.
    patching.install(F.SINGLE_RANK_GROUPS).undo()  # Megatron-FSDP's own constructor again
    try:
        chunks = M.build_model_chunks(spec)
        from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, use_megatron_fsdp=True, overlap_grad_reduce=True,
            data_parallel_sharding_strategy="optim_grads_params", gradient_reduce_div_fusion=False,
        )  # fmt: skip
        model = [FullyShardedDataParallel(config=chunks[0].config, ddp_config=ddp_config, module=chunks[0])]
        get_muon_optimizer(muon_config(spec), model)
        out["single rank"] = "built"
    except ValueError as e:
        out["single rank"] = str(e)
    finally:
        F.fix_gradient_accumulation_on_single_rank_groups()
    return out


def test_refusals_name_the_fix():
    out = run_distributed(_refusals, 1, timeout_s=200)[0]
    assert "data_parallel_sharding_strategy='no_shard' is not supported" in out["no_shard"]
    assert "overlap_grad_reduce=True (--overlap-grad-reduce)" in out["optim without overlap"]
    assert "CPU offload" in out["offload"]
    assert "fix_gradient_accumulation_on_single_rank_groups()" in out["single rank"]
    assert "only as an fsdp_dtensor checkpoint" in out["save"]
