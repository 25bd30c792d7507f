"""MoE experts on real Megatron-core MoE GPT models (CPU, gloo): per-expert matrices in
every expert-parallel layout against the single-process reference, layout equivalence of
fused and per-expert storage, and the expert step overlapping the dense pipeline."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import GBS, MBS, build, max_rel_err, reference, train

MOE = dict(kind="moe")
MOE_SP = dict(kind="moe", sequence_parallel=True)
FP32 = {"fp32": {}}


@pytest.fixture(scope="module")
def moe_reference():
    return run_distributed(reference, 1, MOE, FP32, timeout_s=300)[0]["fp32"]


MOE_LAYOUTS = [
    pytest.param(2, dict(ep=2), MOE, id="EP2"),
    pytest.param(4, dict(ep=2), MOE, id="DP2xEP2"),
    pytest.param(4, dict(tp=2, ep=2), MOE_SP, id="TP2xEP2-SP"),
    pytest.param(4, dict(tp=2, ep=2, etp=2), MOE_SP, id="EP2xETP2"),
    pytest.param(4, dict(pp=2, ep=2), MOE, id="PP2xEP2"),
    # Experts see tokens of every CP rank: expert DP spans data x context parallel ranks.
    pytest.param(4, dict(cp=2, ep=2), MOE, id="CP2xEP2", marks=pytest.mark.slow),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layout,model", MOE_LAYOUTS)
def test_moe_equals_reference(request, moe_reference, world, layout, model):
    variants = FP32
    if request.node.callspec.id in ("EP2", "DP2xEP2"):
        variants = {**FP32, "megatron": dict(muon_buffer_layout="megatron")}  # both DDP buffer layouts
    results = run_distributed(train, world, model, variants, timeout_s=500, **layout)
    ref = M.merge_canonical_states([moe_reference[1]])
    for name in variants:
        full = M.merge_canonical_states([r[name]["state"] for r in results])
        err, key = max_rel_err(full, ref, "fro")
        assert err <= 1e-5, f"{name}: {key} differs from the reference by {err:.2e}"
    # Expert matrices are orthogonalized once each, per expert (never as fused storage).
    expert_stats = [s for r in results for s in r["fp32"]["stats"][1:]]
    assert expert_stats, "no expert optimizer was built"
    # Local layer names repeat on every pipeline stage: qualify them with the stage.
    names = [(r["fp32"]["pp_rank"], n) for r in results for n in r["fp32"]["computed"] if "experts" in n]
    assert len(names) == len(set(names)), sorted(names)
    num_layers, num_experts = 2, 4
    assert len(names) == num_layers * num_experts * 2  # fc1 and fc2 of every expert


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "layout",
    [
        # transformer-engine's TEGroupedMLP naming (linear_fc1.weight<i>: --moe-grouped-gemm on a
        # GPU), by its pure-torch stand-in where transformer-engine is absent
        pytest.param("te_grouped", id="TEGroupedMLP"),
        # fused weight1 / weight2 storage of the legacy GroupedMLP (older checkpoints)
        pytest.param("legacy_grouped", id="legacy-GroupedMLP", marks=pytest.mark.slow),
    ],
)
def test_grouped_expert_storage_equals_reference_at_ep2(moe_reference, layout):
    """Muon on grouped expert storage: each expert's matrices cut out of it and orthogonalized
    on their own, exact against the reference (which trains per-expert SequentialMLP)."""
    results = run_distributed(train, 2, dict(MOE, expert_layout=layout), FP32, timeout_s=500, ep=2)
    full = M.merge_canonical_states([r["fp32"]["state"] for r in results])
    err, key = max_rel_err(full, M.merge_canonical_states([moe_reference[1]]), "fro")
    assert err <= 1e-5, f"{key} differs from the reference by {err:.2e}"
    experts = [n for r in results for n in r["fp32"]["computed"] if "experts" in n]
    assert len(experts) == len(set(experts)) == 2 * 4 * 2, experts  # 2 layers x 4 experts x fc1, fc2


def _overlap_trace():
    """Two MoE steps with and without the overlap; the last step's trace and the weights."""
    from megatron_muon.testing.trace import trace_step

    spec = M.TinyModelSpec(**MOE)
    tokens = M.synthetic_batches(spec, GBS, 2)
    out = {}
    for overlap in (True, False):
        chunks, model, opt, sched = build(spec, muon_overlap_expert_ns=overlap, muon_chunk_numel=4096)
        for batch in tokens:
            with trace_step(opt) as trace:
                M.train_step(model, opt, batch, MBS, spec)
        out[overlap] = dict(trace=trace.events, params=[p.detach().clone() for p in chunks[0].parameters()])
    return out


@pytest.mark.timeout(300)
def test_expert_step_overlaps_first_dense_gather():
    ranks = run_distributed(_overlap_trace, 2, ep=2)
    for r in ranks:
        trace = r[True]["trace"]
        launch = trace.index(("dense", "launch_gather", 0))
        expert_compute = [i for i, e in enumerate(trace) if e[0] == "expert" and e[1] == "compute"]
        complete = trace.index(("dense", "complete_gather", 0))
        assert expert_compute, trace
        assert launch < min(expert_compute) and max(expert_compute) < complete, trace
        # Without the overlap the expert step comes after the dense one.
        plain = r[False]["trace"]
        assert plain.index(("dense", "complete_gather", 0)) < min(
            i for i, e in enumerate(plain) if e[0] == "expert"
        )
        for a, b in zip(r[True]["params"], r[False]["params"]):
            assert torch.equal(a, b), "overlap changed the numbers"


def _moe_50_steps():
    spec = M.TinyModelSpec(**MOE)
    chunks, model, opt, sched = build(spec, lr=0.01, min_lr=0.01)
    batches = M.synthetic_batches(spec, GBS, 4)
    losses = []
    for i in range(50):
        loss, ok = M.train_step(model, opt, batches[i % 4], MBS, spec)
        sched.step(1)
        losses.append(loss)
    return losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_trains_50_steps():
    losses = run_distributed(_moe_50_steps, 2, ep=2)[0]
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses


def test_deepseek_v3_layer_plan_without_building_the_model():
    """The planner on shapes alone: one DeepSeek-V3 MoE layer (256 experts, EP 64)."""
    from megatron_muon.newton_schulz import newton_schulz_flops
    from megatron_muon.testing.synthetic import deepseek_v3_expert_plan

    # Standard NS throughout (the default 'auto' means Gram NS for fc2 on a GPU, which the
    # plan of shapes alone assumes): the counts below are standard's.
    standard = dict(muon_ns_method="standard")
    fc1 = newton_schulz_flops(2 * 2048, 7168)
    fc2 = newton_schulz_flops(7168, 2048)
    for edp in (1, 4, 8):
        stats = deepseek_v3_expert_plan(edp_size=edp, muon_ns_max_ranks=1, **standard)
        assert stats["experts_per_ep_rank"] == 4 and stats["matrices"] == 8
        loads = stats["ns_flops_per_rank"]
        assert len(loads) == edp and sum(loads) == 4 * (fc1 + fc2)
        assert max(loads) - min(loads) <= stats["max_job_flops"]
        # With multi-rank Newton–Schulz (the default) on 8 ranks, each fc1 (more than a rank's
        # mean) is shared by two ranks: a lower maximum, at the price of redundant A A work.
        split_stats = deepseek_v3_expert_plan(edp_size=edp, **standard)
        assert max(split_stats["ns_flops_per_rank"]) <= max(loads)
        assert len(split_stats["multirank_jobs"]) == (4 if edp == 8 else 0), split_stats["multirank_jobs"]
    split = deepseek_v3_expert_plan(edp_size=1, muon_split_glu=True)
    assert split["matrices"] == 12


def _lpt_remote_elements(plan) -> tuple:
    """Least-loaded-only list scheduling of the same jobs (written here, independently of
    the planner): its elements that cross the wire, and its per-rank loads."""
    loads = [0] * plan.group.size
    remote = 0
    for chunk in plan.chunks:
        for job in sorted(chunk.jobs, key=lambda j: (-j.flops, j.index)):
            owner = min(range(plan.group.size), key=lambda r: (loads[r], r))
            loads[owner] += job.flops
            remote += sum(s.numel for s in job.sources + job.dests if plan.group.rank_of(s.tp, s.dp) != owner)
    return remote, loads


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_owners_prefer_ranks_that_hold_the_matrix(dp):
    """Expert matrices of one layer laid out by Megatron's byte-level DDP layout over DP
    ranks: the planner keeps list scheduling's balance bound and moves fewer elements."""
    from types import SimpleNamespace

    from megatron_muon import MuonConfig
    from megatron_muon.planner import plan_statistics
    from megatron_muon.testing.synthetic import moe_expert_layer_shapes, synthetic_plan

    shapes = moe_expert_layer_shapes(16, 1, 256, 384, glu=True)
    plan = synthetic_plan(shapes, SimpleNamespace(gated_linear_unit=True, hidden_size=256),
                          MuonConfig(lr=1e-3, muon_chunk_numel=1 << 20), 1, dp)
    stats = plan_statistics(plan)
    loads = stats["ns_flops_per_rank"]
    assert max(loads) - min(loads) <= stats["max_job_flops"]
    remote = sum(s.numel for j in plan.jobs for s in j.sources + j.dests
                 if plan.group.rank_of(s.tp, s.dp) != j.owner)
    lpt_remote, lpt_loads = _lpt_remote_elements(plan)
    assert max(loads) <= max(lpt_loads) + stats["max_job_flops"]
    assert remote < 0.5 * lpt_remote, (remote, lpt_remote)
