"""The overhead counter of the optimizer-step benchmark (``tools/bench/step_overhead.py``):
ops are sorted into Newton–Schulz and the rest by the NS entry point they run under, copies
and casts are told from arithmetic and views, bytes are what the ops read and write, and
``item()`` counts as a host synchronisation."""

from __future__ import annotations

import torch

from megatron_muon import rule
from tools.bench import step_overhead


def test_ops_inside_newton_schulz_and_outside_are_counted_apart():
    G = torch.randn(3, 8, 16)
    master = torch.zeros(3 * 8 * 16)

    def step():
        wire = G.to(torch.bfloat16)  # a cast: 1536 B read, 768 B written
        ortho = rule.newton_schulz(wire, 2, "quintic", torch.float32)
        master.add_(ortho.reshape(-1), alpha=-0.1)  # arithmetic
        return float(master.sum())  # a host sync

    counts = step_overhead.count_ops(step)
    assert counts["matrices"] == 3  # one stacked call of three matrices
    outside, inside = counts["by_kind"]["outside"], counts["by_kind"]["newton_schulz"]
    assert outside["copy/cast"] == dict(ops=1, bytes=G.numel() * (4 + 2))
    assert outside["sync"]["ops"] == 1
    assert outside["arithmetic"]["ops"] == 2  # add_ and sum
    assert inside["arithmetic"]["ops"] > 5 and inside["sync"]["ops"] == 0  # the iteration's products
    (row,) = step_overhead.overhead_rows("x", counts)
    assert row[:3] == ["x", 3, 4]


def test_counts_of_several_ranks_add_up():
    one = step_overhead.count_ops(lambda: rule.newton_schulz(torch.randn(4, 4), 1))
    both = step_overhead.merge_counts([one, one])
    assert both["matrices"] == 2 and both["ranks"] == 2
    ns = both["by_kind"]["newton_schulz"]["arithmetic"]
    assert ns == {k: 2 * v for k, v in one["by_kind"]["newton_schulz"]["arithmetic"].items()}


def test_the_entry_points_are_restored():
    before = rule.newton_schulz
    step_overhead.count_ops(lambda: None)
    assert rule.newton_schulz is before
