"""Where the owner-aligned DDP buffers send Muon's pieces, counted on DP2 x TP2 (4 gloo
ranks): inside the tensor-parallel group only, against Megatron's byte-level layout."""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M


def _counted_step(spec: M.TinyModelSpec, layout: str):
    """``(model, optimizer, traffic)`` of one optimizer step of ours, its collectives counted."""
    from megatron_muon.testing.traffic import count_collectives
    from tests.helpers.training import MBS, GBS, build

    _, model, opt, _ = build(spec, muon_buffer_layout=layout)
    tokens = M.synthetic_batches(spec, GBS, 1)[0]
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, MBS, spec)
    with count_collectives() as traffic:
        opt.step()
    return model, opt, traffic


def _count_step(layout: str):
    """Bytes by process-group kind of one optimizer step of ours on DP2 x TP2."""
    _, opt, traffic = _counted_step(M.TinyModelSpec(kind="gqa"), layout)
    return dict(kinds=dict(traffic.bytes), groups=dict(traffic.by_group), owner=opt.muon_optimizers[0].owner_aligned)


@pytest.mark.timeout(300)
def test_owner_aligned_layout_sends_muon_pieces_only_inside_the_tp_group():
    owner, megatron = (run_distributed(_count_step, 4, layout, tp=2, timeout_s=250) for layout in ("owner_aligned", "megatron"))
    for r in owner:
        assert r["owner"]
        # Over DP only Megatron's parameter all-gather; every Muon piece moves inside TP.
        assert r["groups"].get("dp", 0) == r["kinds"].get("all_gather", 0)
        assert r["groups"].get("tp", 0) == r["kinds"].get("all_to_all", 0) > 0
    assert not megatron[0]["owner"]
    assert sum(r["groups"].get("dp", 0) for r in megatron) > sum(r["groups"].get("dp", 0) for r in owner)


def _moe_param_all_gather(layout: str):
    """One MoE optimizer step (dense + expert optimizers chained): the parameter all-gather
    bytes counted, and what one all-gather of every DDP buffer sends."""
    import torch.distributed as dist

    model, opt, traffic = _counted_step(M.TinyModelSpec(kind="moe", num_moe_experts=4), layout)
    once = 0
    for chunk in model:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            n = dist.get_world_size(buffer.data_parallel_group)
            once += (n - 1) * buffer.param_data.numel() * buffer.param_data.element_size() // n
    return dict(optimizers=len(opt.muon_optimizers), counted=traffic.bytes.get("all_gather", 0), once=once)


@pytest.mark.timeout(300)
def test_moe_parameters_are_all_gathered_once_per_step():
    # Dense and expert optimizers share the model chunks; each all-gathers only the bucket
    # groups of its own buffers (walking all of them gathered every group twice).
    for layout in ("owner_aligned", "megatron"):
        for r in run_distributed(_moe_param_all_gather, 4, layout, ep=2, timeout_s=250):
            assert r["optimizers"] == 2 and r["counted"] == r["once"] > 0, (layout, r)
