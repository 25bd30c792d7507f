"""Reshardable Muon checkpoints (Megatron dist-checkpointing, torch_dist) on real
Megatron-core models, CPU + gloo: save in one layout, load in another, lose nothing."""

from __future__ import annotations

import os

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


# ---------------------------------------------------------------------------------------
# A state added to the registry is saved, resharded and converted with no other change
# ---------------------------------------------------------------------------------------

DUMMY = "dummy_statistic"


def _register_dummy(required: bool = False) -> None:
    """In a rank: one more per-matrix state in ``state.MUON_STATES``, kept per shard (what
    adding a state to megatron_muon is: the registry, then the maths that writes it)."""
    from megatron_muon import state

    state.MUON_STATES = state.MUON_STATES + (state.MatrixState(DUMMY, "shard", lambda config: True, required=required),)


def _muon_masters(opt):
    """(master, its optimizer's state) of every Muon matrix this rank holds a range of."""
    for inner in opt.muon_optimizers:
        for shard in inner.shard_map:
            if shard.master is not None and id(shard.param) in inner.muon_param_ids:
                yield shard.master, inner.optimizer.state[shard.master]


def _save_with_dummy(ckpt_dir):
    from megatron_muon.checkpoint import save_checkpoint

    _register_dummy()
    spec = M.TinyModelSpec(kind="gqa")
    chunks, model, opt, sched = build(spec)
    train_steps(model, opt, sched, spec, M.synthetic_batches(spec, GBS, 2))
    for master, state in _muon_masters(opt):
        state[DUMMY].copy_(3 * master)  # "the maths": a value each layout can check
    save_checkpoint(ckpt_dir, model, opt, extra={"iteration": 2})
    return sum(1 for _ in _muon_masters(opt))


def _load_with_dummy(ckpt_dir):
    """The dummy's values after a load, per Muon master: (equal to 3x the master, zero)."""
    from megatron_muon.checkpoint import load_checkpoint

    spec = M.TinyModelSpec(kind="gqa")
    chunks, model, opt, sched = build(spec)
    load_checkpoint(ckpt_dir, model, opt)
    return [(bool(torch.equal(state[DUMMY], 3 * master)), bool((state[DUMMY] == 0).all()))
            for master, state in _muon_masters(opt)]  # fmt: skip


def _load_and_convert(ckpt_dir, adam_dir, back_dir):
    """Load at this layout; muon-to-adam, then adam-to-muon; load what came back, with the
    dummy optional, then required."""
    import dataclasses

    from megatron_muon import state
    from megatron_muon.checkpoint import CheckpointError
    from megatron_muon.megatron_lm import convert

    _register_dummy()
    out = {"loaded": _load_with_dummy(ckpt_dir)}
    convert.muon_to_adam(ckpt_dir, adam_dir)
    out["adam_keys"] = sorted(convert.read_checkpoint(convert.resolve_source(adam_dir)).tensors)
    convert.adam_to_muon(adam_dir, back_dir)
    back = os.path.join(back_dir, "iter_0000002")
    out["started"] = _load_with_dummy(back)
    state.MUON_STATES = tuple(dataclasses.replace(s, required=s.name == DUMMY or s.required) for s in state.MUON_STATES)
    try:
        _load_with_dummy(back)
    except CheckpointError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_state_added_to_the_registry_is_saved_resharded_and_converted(tmp_path):
    """A dummy per-matrix state registered in ``state.py`` alone: saved at TP2, loaded at
    TP1 with its values; muon-to-adam drops it with the other Muon states; a Muon checkpoint
    without it (adam-to-muon's) starts it at zero, or is refused naming it when the registry
    says a checkpoint must hold it."""
    ckpt, adam, back = (str(tmp_path / name) for name in ("ckpt", "adam", "back"))
    assert all(n > 0 for n in run_distributed(_save_with_dummy, 2, ckpt, timeout_s=400, tp=2))
    r = run_distributed(_load_and_convert, 1, ckpt, adam, back, timeout_s=400)[0]
    assert r["loaded"] and all(same for same, _ in r["loaded"]), r["loaded"]
    assert r["adam_keys"] and not any(DUMMY in k or "momentum_buffer" in k for k in r["adam_keys"])
    assert r["started"] and all(zero for _, zero in r["started"]), r["started"]
    assert f"optimizer.state.{DUMMY}." in r.get("refused", ""), r
