"""tools/bench/startup.py: one rank's start-up built from shapes alone, on a small layout
where every answer can be written down (Megatron's rank order: TP fastest, then EP / DP,
PP outermost)."""

from unittest import mock

import pytest

from tools.bench import model_shapes as S
from tools.bench import startup
from tools.bench.scale_model import Cluster

# 16 ranks: TP2 x PP2 x DP4; experts EP2 x ETP2 x EDP2. Rank 5 is tp 1, dp 2 of stage 0.
CLUSTER = Cluster(gpus=16, tp=2, pp=2, ep=2, gpus_per_node=4)
MOE = dict(kind="moe", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)


def test_the_orthogonalization_group_is_built_by_the_package_in_megatrons_order():
    from megatron_muon import process_groups
    from megatron_muon.process_groups import build_ortho_group

    world = startup.SimulatedWorld(CLUSTER, me=5)
    assert world.tp["dense"][5] == [4, 5] and world.dp["dense"][5] == [1, 3, 5, 7]
    with world.installed("dense", CLUSTER.gpus_per_node):
        group = build_ortho_group(world.group("dense", "tp"), world.group("dense", "dp"))
        created = [ranks for kind, ranks in process_groups._GROUPS if kind == "ortho"]
    # Every rank's group, created in the order of their member tuples.
    tp, dp = world.tp["dense"], world.dp["dense"]
    assert created == sorted({tuple(sorted(t for d in dp[r] for t in tp[d])) for r in range(16)})
    assert created == [tuple(range(8)), tuple(range(8, 16))]
    assert group.group.ranks == list(range(8)) and group.rank == 5
    assert group.coords == [(r % 2, r // 2) for r in range(8)]
    assert group.nodes == (0, 0, 0, 0, 1, 1, 1, 1)
    # TP and DP both > 1: every rank of the world sent its group's lowest rank and size.
    assert world.gathered == 4 + 16
    # Expert decomposition: ETP2 fastest, then EP2, then EDP2.
    assert world.tp["expert"][5] == [4, 5] and world.dp["expert"][5] == [1, 5]


def test_groups_that_do_not_partition_the_world_are_refused():
    from megatron_muon import process_groups

    class World:  # rank 0 says {0, 1}; rank 2 says its group starts at 0 too, with 2 ranks
        def get_world_size(self):
            return 4

        def all_gather_object(self, out, obj, group=None):
            out[:] = [(0, 2), (0, 2), (0, 2), (3, 1)]

    with mock.patch.object(process_groups, "dist", World()):
        with pytest.raises(RuntimeError, match="do not partition the world"):
            process_groups._every_ortho_group((0, 1))


def test_one_rank_start_up_reports_every_step():
    m = S.from_tiny(MOE, global_batch=8)
    data = startup.measure(m, CLUSTER, rank=8)  # the first rank of stage 1
    steps = [row["step"] for row in data["rows"]]
    for kind in ("dense", "expert"):
        for step in ("logical matrices", "shard map", "process groups", "plan", "messages"):
            assert f"{kind}: {step}" in steps
    counts = data["counts"]
    assert counts["stage"] == 1
    assert counts["dense"]["group_size"] == 8 and counts["expert"]["group_size"] == 4
    assert counts["dense"]["matrices"] > 0 and counts["expert"]["matrices"] > 0
    # Each DP rank's range of every parameter of the optimizer's buffers.
    assert counts["dense"]["shard_map_ranges"] % 4 == 0 and counts["expert"]["shard_map_ranges"] % 2 == 0
    assert data["peak_bytes"] >= data["kept_bytes"] > 0
    text = startup.markdown(dict(env=_env(), results={"tiny": dict(data, model="tiny_moe", gpus=16, note="test")}))
    assert "dense: plan" in text and "expert: messages" in text


def _env():
    return dict(date="today", device_name="CPU", versions={"torch": "x"}, command="test")
