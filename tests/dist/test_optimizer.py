"""MuonDistributedOptimizer on real Megatron-core GPT models (GQA, SwiGLU), CPU + gloo.

Every distributed layout is checked against ``megatron_muon.reference`` (a single-process
Muon over full matrices of a one-rank model), not against our own output. Each spawned
run does several checks, since starting ranks costs seconds of imports.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import BF16_NS, max_rel_err, reference, train

VARIANTS = {"fp32": {}, "bf16": BF16_NS}
# Finer logical matrices (per head / per query group, gate and up apart), and a pipeline
# of many small chunks with two gathers in flight: checked on DP2 x TP2.
EXTRA = {
    "split": dict(muon_qkv_granularity="head", muon_split_glu=True),
    "group": dict(muon_qkv_granularity="group"),
    "chunks": dict(muon_chunk_numel=3000, muon_max_inflight_chunks=2),
    # Megatron's byte-level DDP layout (the other variants use the owner-aligned default).
    "megatron": dict(muon_buffer_layout="megatron"),
    # Gram Newton–Schulz against the reference's own (standard) iteration.
    "gram": dict(muon_ns_method="gram"),
}
# Same numbers with DDP overlapping the grad reduce-scatter and param all-gather, in small
# buckets (so parameters straddle bucket and shard boundaries).
OVERLAP = {"ddp": dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000)}
DENSE = dict(kind="gqa")
VPP_MODEL = dict(kind="gqa", num_layers=4)


@pytest.fixture(scope="module")
def references():
    return run_distributed(_references, 1, timeout_s=300)[0]


def _references():
    return {"dense": reference(DENSE, {**VARIANTS, **EXTRA}), "vpp": reference(VPP_MODEL, {"fp32": {}})}


LAYOUTS = [
    pytest.param(2, dict(), DENSE, id="DP2"),
    pytest.param(2, dict(), DENSE, id="DP2-overlap"),
    pytest.param(2, dict(tp=2), DENSE, id="TP2"),
    pytest.param(4, dict(tp=2), DENSE, id="DP2xTP2"),
    pytest.param(4, dict(), DENSE, id="DP4"),
    pytest.param(4, dict(pp=2), DENSE, id="PP2xDP2"),
    pytest.param(8, dict(tp=2, pp=2, vpp=2), VPP_MODEL, id="DP2xTP2xPP2-VPP2"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layout,model", LAYOUTS)
def test_equals_single_process_reference(request, references, world, layout, model):
    variants = VARIANTS if model is DENSE else {"fp32": {}}
    if request.node.callspec.id == "DP2-overlap":
        variants = {"fp32": OVERLAP}
    if request.node.callspec.id == "DP2xTP2":
        variants = {**VARIANTS, **EXTRA}
    if request.node.callspec.id in ("DP2", "PP2xDP2"):
        variants = {**variants, "megatron": EXTRA["megatron"]}  # both DDP buffer layouts
    results = run_distributed(train, world, model, variants, timeout_s=500, **layout)
    ref = references["dense" if model is DENSE else "vpp"]
    for name in variants:
        full = M.merge_canonical_states([r[name]["state"] for r in results])
        ref_state = M.merge_canonical_states([ref[name][1]])
        # Per-parameter relative (Frobenius) error. Muon matrices are also held to 1e-5
        # elementwise in fp32; AdamW parameters are not, because AdamW turns the tiny
        # reduction-order differences of distributed gradients into visible steps on entries
        # whose gradient is near zero (its update is about sign(g) * lr there).
        tol = 2e-2 if name == "bf16" else 1e-5
        err, key = max_rel_err(full, ref_state, "fro")
        assert err <= tol, f"{name}: {key} differs from the reference by {err:.2e} (tolerance {tol})"
        if name != "bf16":
            muon_keys = {k: v for k, v in ref_state.items() if v.dim() >= 3 and "embedding" not in k
                         and "output_layer" not in k and "norm" not in k}
            err, key = max_rel_err(full, muon_keys, "max")
        assert err <= tol, f"{name}: {key} differs from the reference by {err:.2e} (tolerance {tol})"
        for ours, theirs in zip(results[0][name]["losses"], ref[name][0]):
            assert math.isclose(ours, theirs, rel_tol=tol), (ours, theirs)

    if "chunks" in variants:
        assert results[0]["chunks"]["stats"][0]["chunks"] > 4, "the chunked variant should pipeline"
    # Each logical matrix was orthogonalized on exactly one rank, and the work is balanced.
    for stage in {r["fp32"]["pp_rank"] for r in results}:
        ranks = [r["fp32"] for r in results if r["fp32"]["pp_rank"] == stage]
        computed = [n for r in ranks for n in r["computed"]]
        assert len(computed) == len(set(computed)), "a matrix was orthogonalized twice"
        stats = ranks[0]["stats"][0]
        assert len(computed) == stats["matrices"], (len(computed), stats["matrices"])
        loads = stats["ns_flops_per_rank"]
        share = sum(loads) / len(loads)
        assert max(abs(load - share) for load in loads) <= stats["max_job_flops"]


# One layer with a wide MLP on 4 ranks: fc1 (1024 x 64) and fc2 (64 x 512) each cost more
# than a rank's mean Newton–Schulz load, so the plan spreads fc1 over 4 ranks and fc2 over 2
# (links priced at 0: at real link speeds that does not pay for matrices this small).
SPLIT_MODEL = dict(kind="gqa", num_layers=1, ffn_hidden_size=512)
FREE_LINKS = dict(muon_ns_intra_node_flops_per_byte=0.0, muon_ns_inter_node_flops_per_byte=0.0)
SPLIT_VARIANTS = {"fp32": FREE_LINKS, "unsplit": dict(muon_ns_max_ranks=1), "bf16": {**BF16_NS, **FREE_LINKS}}


def _multirank_runs():
    """The optimizer with and without multi-rank NS, plus the multi-rank kernel on its own
    against newton_schulz (fp32) for groups of 2 and 4 ranks and a tall matrix."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_muon.multirank_newton_schulz import multirank_newton_schulz, multirank_traffic
    from megatron_muon.newton_schulz import resolve_coefficients
    from megatron_muon.rule import newton_schulz
    from megatron_muon.process_groups import subgroup
    from megatron_muon.testing.traffic import count_collectives

    out = train(SPLIT_MODEL, SPLIT_VARIANTS)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3)
    errors = {}
    schedule = resolve_coefficients("polar_express").schedule(5)
    for members, shape in (((0, 1), (24, 90)), ((0, 1, 2, 3), (90, 24)), ((2, 3, 0, 1), (33, 101))):
        G = torch.randn(*shape, generator=g)
        if rank not in members:
            continue
        group = subgroup(SimpleNamespace(group=dist.group.WORLD), members)
        with count_collectives() as traffic:
            result = multirank_newton_schulz(G if rank == members[0] else None, shape, group, tuple(sorted(members)),
                                             members[0], schedule, torch.float32, None)
        # The bytes counted are the ones the scale model prices (block upper triangle of A).
        modelled = multirank_traffic(*shape, 5, len(members), 4)["all_reduce"]
        assert traffic.bytes["all_reduce"] == modelled, (dict(traffic.bytes), modelled)
        if rank == members[0]:
            exact = newton_schulz(G, 5, "polar_express", torch.float32)
            errors[f"{len(members)} ranks {shape}"] = ((result - exact).abs().max() / exact.abs().max()).item()
    out["kernel_errors"] = errors
    return out


@pytest.mark.timeout(600)
def test_multirank_newton_schulz_equals_reference_and_one_rank():
    results = run_distributed(_multirank_runs, 4, timeout_s=500)
    ref = run_distributed(reference, 1, SPLIT_MODEL, {"fp32": {}, "bf16": BF16_NS}, timeout_s=300)[0]
    stats = results[0]["fp32"]["stats"][0]
    assert stats["multirank_jobs"] == {
        "decoder.layers.0.mlp.linear_fc1.weight": 4, "decoder.layers.0.mlp.linear_fc2.weight": 2}, stats
    assert results[0]["unsplit"]["stats"][0]["multirank_jobs"] == {}
    errors = {k: v for r in results for k, v in r["kernel_errors"].items()}
    assert len(errors) == 3 and max(errors.values()) < 1e-5, errors
    for name, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        full = M.merge_canonical_states([r[name]["state"] for r in results])
        err, key = max_rel_err(full, M.merge_canonical_states([ref[name][1]]), "fro")
        assert err <= tol, f"{name}: {key} differs from the reference by {err:.2e}"
    split = M.merge_canonical_states([r["fp32"]["state"] for r in results])
    unsplit = M.merge_canonical_states([r["unsplit"]["state"] for r in results])
    mlp = {k: v for k, v in unsplit.items() if "linear_fc" in k}
    err, key = max_rel_err(split, mlp, "max")
    assert err <= 1e-5, f"multi-rank vs one rank: {key} differs by {err:.2e}"
    # Every matrix computed once (by its owner; a multi-rank one by its leader).
    computed = [n for r in results for n in r["fp32"]["computed"]]
    assert len(computed) == len(set(computed)) == stats["matrices"]
    # The multi-rank jobs sent their blocks and all-reduced their Gram matrices.
    sent = {run: {k: sum(r[run]["traffic"].get(k, 0) for r in results) for k in ("scatter", "all_reduce")}
            for run in ("fp32", "unsplit")}
    assert sent["fp32"]["scatter"] > 0 == sent["unsplit"]["scatter"], sent
    assert sent["fp32"]["all_reduce"] > sent["unsplit"]["all_reduce"], sent
