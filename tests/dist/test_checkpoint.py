"""Reshardable Muon checkpoints (Megatron dist-checkpointing, torch_dist) on real
Megatron-core models, CPU + gloo: save in one layout, load in another, lose nothing."""

from __future__ import annotations


import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import GBS, build, max_rel_err, train_steps

STEPS_BEFORE, STEPS_AFTER = 3, 2


def _save_then_continue(spec_kwargs, ckpt_dir, cfg=None):
    """Train, save, record the optimizer state; then continue as if nothing happened."""
    from megatron_muon.checkpoint import save_checkpoint

    spec = M.TinyModelSpec(**spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, STEPS_BEFORE + STEPS_AFTER)
    chunks, model, opt, sched = build(spec, **(cfg or {}))
    train_steps(model, opt, sched, spec, batches[:STEPS_BEFORE])
    saved_state = M.gather_canonical_optimizer_state(model, opt)
    save_checkpoint(ckpt_dir, model, opt, extra={"iteration": STEPS_BEFORE})
    train_steps(model, opt, sched, spec, batches[STEPS_BEFORE:])
    return dict(state=saved_state, final=M.gather_canonical_state(chunks))


def _load_then_continue(spec_kwargs, ckpt_dir, load_layout=None, cfg=None):
    from megatron_muon.checkpoint import load_checkpoint

    spec = M.TinyModelSpec(**dict(spec_kwargs, **(load_layout or {})))
    batches = M.synthetic_batches(spec, GBS, STEPS_BEFORE + STEPS_AFTER)
    chunks, model, opt, sched = build(spec, **(cfg or {}))
    extra = load_checkpoint(ckpt_dir, model, opt)
    loaded_state = M.gather_canonical_optimizer_state(model, opt)
    train_steps(model, opt, sched, spec, batches[STEPS_BEFORE:])
    return dict(state=loaded_state, final=M.gather_canonical_state(chunks), extra=extra, steps=opt.num_steps)


MOE = dict(kind="moe")
CHANGES = [
    pytest.param(dict(kind="gqa"), (2, dict(tp=2)), (1, {}), id="TP2-to-TP1"),
    pytest.param(dict(kind="gqa"), (2, {}), (4, {}), id="DP2-to-DP4"),
    pytest.param(dict(kind="gqa"), (2, dict(pp=2)), (1, {}), id="PP2-to-PP1"),
    pytest.param(MOE, (2, dict(ep=2)), (1, {}), id="EP2-to-EP1"),
    pytest.param(dict(MOE, sequence_parallel=True), (4, dict(tp=2, ep=2, etp=2)), (4, dict(tp=2, ep=2, etp=1)), id="ETP2-to-ETP1", marks=pytest.mark.slow),
    pytest.param(dict(MOE, expert_layout="legacy_grouped"), (2, dict(ep=2)), (2, dict(ep=2)), id="GroupedMLP-to-SequentialMLP", marks=pytest.mark.slow),
    pytest.param(MOE, (2, dict(ep=2)), (1, {}), id="SequentialMLP-to-GroupedMLP"),
    # DDP buffer layouts: owner-aligned (the default) <-> Megatron's byte-level, and TP/DP too.
    pytest.param(dict(kind="gqa"), (2, {}), (2, dict(tp=2)), id="owner-DP2-to-megatron-TP2"),
    pytest.param(MOE, (4, dict(ep=2)), (2, dict(ep=2)), id="megatron-DP2xEP2-to-owner-EP2"),
]
# MuonConfig overrides (save, load) where a case changes them.
CFG = {
    "owner-DP2-to-megatron-TP2": ({}, dict(muon_buffer_layout="megatron")),
    "megatron-DP2xEP2-to-owner-EP2": (dict(muon_buffer_layout="megatron"), {}),
}
# The model built at load time, where it differs from the saved one.
LOAD_LAYOUT = {
    "GroupedMLP-to-SequentialMLP": dict(expert_layout="sequential"),
    "SequentialMLP-to-GroupedMLP": dict(expert_layout="legacy_grouped"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,before,after", CHANGES)
def test_layout_change_is_lossless(request, tmp_path, model, before, after):
    ckpt = str(tmp_path / "ckpt")
    load_layout = LOAD_LAYOUT.get(request.node.callspec.id)
    save_cfg, load_cfg = CFG.get(request.node.callspec.id, ({}, {}))
    saved = run_distributed(_save_then_continue, before[0], model, ckpt, save_cfg, timeout_s=400, **before[1])
    loaded = run_distributed(_load_then_continue, after[0], model, ckpt, load_layout, load_cfg, timeout_s=400,
                             **after[1])
    state_before = M.merge_canonical_states([r["state"] for r in saved])
    state_after = M.merge_canonical_states([r["state"] for r in loaded])
    assert state_before.keys() == state_after.keys()
    for key in state_before:
        assert torch.equal(state_before[key], state_after[key]), f"{key} changed across save/load"
    assert loaded[0]["extra"] == {"iteration": STEPS_BEFORE}
    assert loaded[0]["steps"] == STEPS_BEFORE + STEPS_AFTER
    final_before = M.merge_canonical_states([r["final"] for r in saved])
    final_after = M.merge_canonical_states([r["final"] for r in loaded])
    err, key = max_rel_err(final_after, final_before, "fro")
    assert err <= 1e-5, f"after resuming, {key} differs from the uninterrupted run by {err:.2e}"
