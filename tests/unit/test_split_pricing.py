"""The planner's split Newton–Schulz rule weighs the blocking bytes of a split (priced per
link class, ``SplitCost``) against the FLOPs it saves, on shapes alone (meta tensors)."""

from types import SimpleNamespace

from megatron_muon import MuonConfig
from megatron_muon.planner import plan_statistics
from megatron_muon.split_newton_schulz import SplitCost
from megatron_muon.synthetic import ParamShape, synthetic_plan

FREE = dict(muon_split_ns_intra_flops_per_byte=0.0, muon_split_ns_inter_flops_per_byte=0.0)


def _plan(shapes, hidden, dp, gpus_per_node=None, **cfg):
    model = SimpleNamespace(gated_linear_unit=False, hidden_size=hidden)
    return synthetic_plan(shapes, model, MuonConfig(lr=1e-3, **cfg), 1, dp, gpus_per_node)


def _bound(plan, cost: SplitCost) -> float:
    return max(cost.rank_flops(plan.jobs, plan.loads, 5))


def test_small_matrices_are_not_split_at_real_link_speeds():
    # fc1 / fc2 exceed a rank's mean load, but their all-reduces take longer than the FLOPs
    # saved. (Twice as wide, 4096 x 256 now pays: only the Gram matrix's upper triangle is
    # all-reduced, 5.03 GFLOP-equivalent over 8 ranks against 5.54 whole.)
    shapes = [ParamShape("fc1", (2048, 256), parent_attr="linear_fc1"),
              ParamShape("fc2", (256, 1024), parent_attr="linear_fc2")]
    shapes += [ParamShape(f"proj{i}", (256, 256), parent_attr="linear_proj") for i in range(8)]
    assert plan_statistics(_plan(shapes, 256, 16, **FREE))["split_jobs"] == {"fc1": 8, "fc2": 4}
    assert plan_statistics(_plan(shapes, 256, 16))["split_jobs"] == {}


def test_large_matrix_split_where_it_shortens_the_step():
    # DeepSeek-V3's dense fc1 (36864 x 7168, ~42 TFLOP) among small matrices on 16 ranks.
    shapes = [ParamShape("fc1", (36864, 7168), parent_attr="linear_fc1")]
    shapes += [ParamShape(f"proj{i}", (7168, 1024), parent_attr="linear_proj") for i in range(12)]
    cfg = MuonConfig(lr=1e-3)
    intra = SplitCost(cfg.muon_split_ns_intra_flops_per_byte, cfg.muon_split_ns_inter_flops_per_byte, lambda r: r // 8)
    one_node = _plan(shapes, 7168, 16, gpus_per_node=8)
    unsplit = _plan(shapes, 7168, 16, gpus_per_node=8, muon_split_ns_max_ranks=1)
    flops_only = _plan(shapes, 7168, 16, gpus_per_node=8, **FREE)
    assert plan_statistics(one_node)["split_jobs"] == {"fc1": 8}
    # The chosen plan's busiest rank (FLOPs + FLOP-equivalent split bytes) is the lowest.
    assert _bound(one_node, intra) < _bound(unsplit, intra)
    assert _bound(one_node, intra) <= _bound(flops_only, intra)
    # Every rank on its own node: the all-reduces cross the NIC, ~9x slower; the rule
    # still never does worse than leaving the matrix whole.
    apart = SplitCost(intra.intra_flops_per_byte, intra.inter_flops_per_byte, lambda r: r)
    spread = _plan(shapes, 7168, 16, gpus_per_node=1)
    assert _bound(spread, apart) <= _bound(_plan(shapes, 7168, 16, gpus_per_node=1, muon_split_ns_max_ranks=1), apart)
    assert _bound(spread, apart) > _bound(one_node, intra)


def test_link_prices_are_validated():
    import pytest

    with pytest.raises(ValueError, match="muon_split_ns_inter_flops_per_byte"):
        MuonConfig(lr=1e-3, muon_split_ns_inter_flops_per_byte=-1.0)
