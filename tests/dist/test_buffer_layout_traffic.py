"""Where the owner-aligned DDP buffers send Muon's pieces, counted on DP2 x TP2 (4 gloo
ranks): inside the tensor-parallel group only, against Megatron's byte-level layout."""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M


def _count_step(layout: str):
    """Bytes by process-group kind of one optimizer step of ours on DP2 x TP2."""
    from megatron_muon.traffic import count_collectives
    from tests.helpers.training import MBS, GBS, build

    spec = M.TinyModelSpec(kind="gqa")
    _, model, opt, _ = build(spec, muon_buffer_layout=layout)
    tokens = M.synthetic_batches(spec, GBS, 1)[0]
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, MBS, spec)
    with count_collectives() as traffic:
        opt.step()
    return dict(kinds=dict(traffic.bytes), groups=dict(traffic.by_group), owner=opt.muon_optimizers[0].owner_layout)


@pytest.mark.timeout(300)
def test_owner_layout_sends_muon_pieces_only_inside_the_tp_group():
    owner, megatron = (run_distributed(_count_step, 4, layout, tp=2, timeout_s=250) for layout in ("owner", "megatron"))
    for r in owner:
        assert r["owner"]
        # Over DP only Megatron's parameter all-gather; every Muon piece moves inside TP.
        assert r["groups"].get("dp", 0) == r["kinds"].get("all_gather", 0)
        assert r["groups"].get("tp", 0) == r["kinds"].get("all_to_all", 0) > 0
    assert not megatron[0]["owner"]
    assert sum(r["groups"].get("dp", 0) for r in megatron) > sum(r["groups"].get("dp", 0) for r in owner)
