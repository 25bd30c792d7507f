"""nanochat's Muon variants (variance reduction, cautious weight decay) and the CPU offload
of the momentum, on real Megatron-core GPT models (CPU, gloo), against the single-process
reference; plus their state in checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.cautious import merge_masks, reference_with_masks, train_recording_masks
from tests.helpers.training import GBS, MASTER_OFFLOAD, MBS, build, max_rel_err, reference, train, train_steps

VR = dict(muon_variance_reduction=0.9)
CAUTIOUS = dict(muon_cautious_weight_decay=True)
OFFLOAD = dict(muon_cpu_offload=True)
# Small chunks, so that the offload moves the momentum chunk by chunk. Cautious weight decay
# is checked on its own (tests.helpers.cautious: the reference applies the run's mask).
VARIANTS = {
    "plain": {},
    "vr": VR,
    "offload": dict(OFFLOAD, muon_chunk_numel=3000),
}
DENSE = dict(kind="gqa")
MOE = dict(kind="moe")


def nanochat_variance_reduction(g: torch.Tensor, buf: torch.Tensor, beta2: float) -> torch.Tensor:
    """The seed's definition (nanochat ``muon_step_fused``), transcribed for the test."""
    red_dim = -1 if g.size(-2) >= g.size(-1) else -2
    v_mean = g.square().mean(dim=red_dim, keepdim=True)
    n = g.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    buf.lerp_(v_mean, 1 - beta2)
    step = buf.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * n) * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return g * (step * (v_norm / v_norm_new.clamp_min(1e-10)))


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5)])
def test_variance_reduction_matches_nanochat(shape):
    from megatron_muon.testing.reference import normuon
    from megatron_muon.rule import variance_reduction_

    torch.manual_seed(0)
    rows, cols = shape
    buf_shape = (rows, 1) if rows >= cols else (1, cols)
    seed_buf, our_buf, ref_moment = torch.zeros(buf_shape), torch.zeros(1, *buf_shape), None
    for _ in range(3):
        o = torch.randn(shape) * torch.rand(rows, 1) * torch.rand(1, cols)
        expected = nanochat_variance_reduction(o.clone(), seed_buf, 0.9)
        ours = variance_reduction_(o.unsqueeze(0), our_buf, 0.9)[0]
        ref, ref_moment = normuon(o, ref_moment, 0.9)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ref, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(our_buf[0], seed_buf)
        torch.testing.assert_close(ref_moment, seed_buf.reshape(-1))
        assert math.isclose(float(ours.norm()), float(o.norm()), rel_tol=1e-5)  # norm kept
        assert not torch.allclose(ours, o)


def test_cautious_decay_only_where_signs_agree():
    from megatron_muon.rule import decay_and_update_

    w = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])
    u = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.5])
    decay_and_update_(w, u, lr=0.1, wd=0.5, cautious=True)
    # decay lr*wd*w = 0.05*w where u*w >= 0 (entries 0, 3, 4), then w -= lr*u
    expected = torch.tensor([1.0 - 0.05 - 0.05, -1.0 - 0.05, 1.0 + 0.05, -1.0 + 0.05 + 0.05, -0.05])
    torch.testing.assert_close(w, expected)


def _references():
    return {"dense": reference(DENSE, VARIANTS), "moe": reference(MOE, VARIANTS)}


@pytest.fixture(scope="module")
def references():
    return run_distributed(_references, 1, timeout_s=400)[0]


def _check_exact(results, ref, variants):
    for name in list(variants) + ["cautious"]:
        full = M.merge_canonical_states([r[name]["state"] for r in results])
        ref_state = M.merge_canonical_states([ref[name][1]])
        err, key = max_rel_err(full, ref_state, "fro")
        assert err <= 1e-5, f"{name}: {key} differs from the reference by {err:.2e}"
        for ours, theirs in zip(results[0][name]["losses"], ref[name][0]):
            assert math.isclose(ours, theirs, rel_tol=1e-5), (name, ours, theirs)
    # The variants change training (the reference sees them).
    plain = M.merge_canonical_states([ref["plain"][1]])
    for name in ("vr", "cautious"):
        err, _ = max_rel_err(M.merge_canonical_states([ref[name][1]]), plain, "fro")
        assert err > 1e-4, f"{name} did not change the reference's result ({err:.2e})"


LAYOUTS = [
    pytest.param(4, dict(tp=2), "dense", id="DP2xTP2"),
    pytest.param(4, dict(ep=2), "moe", id="DP2xEP2"),
]


def _train_variants(spec_kwargs: dict) -> dict:
    out = train(spec_kwargs, VARIANTS)
    out["cautious"] = train_recording_masks(spec_kwargs, CAUTIOUS)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,layout,model", LAYOUTS)
def test_variants_equal_reference(references, world, layout, model):
    spec = DENSE if model == "dense" else MOE
    results = run_distributed(_train_variants, world, spec, timeout_s=800, **layout)
    masks = merge_masks([r["cautious"]["masks"] for r in results])
    losses, state, flips = run_distributed(reference_with_masks, 1, spec, CAUTIOUS, masks, timeout_s=300)[0]
    _check_exact(results, dict(references[model], cautious=(losses, state)), VARIANTS)
    # The mask the run applied is the reference's own but for a few elements whose
    # update * weight is within rounding of zero.
    flipped = sum(n for step in flips for n, _, _ in step.values())
    total = sum(t for step in flips for _, t, _ in step.values())
    nearest = max((rel for step in flips for _, _, rel in step.values()), default=0.0)
    assert flipped <= 1e-3 * total and nearest <= 1e-4, (flipped, total, nearest)


# ---------------------------------------------------------------------------------------
# The fp32 masters offloaded too (Megatron's optimizer_cpu_offload), on a bf16 model
# ---------------------------------------------------------------------------------------
OFFLOAD_MASTERS = dict(MASTER_OFFLOAD, muon_chunk_numel=3000)
QK = dict(qk_clip=True, qk_clip_threshold=0.04)  # low: QK-Clip rescales the offloaded masters
MASTER_OFFLOAD_MODES = {
    "exact": dict(muon_tp_mode="exact", **CAUTIOUS),
    "duplicated": dict(muon_tp_mode="duplicated", **CAUTIOUS),
    # Hyperball's apply reduces each matrix's norms over the staged masters' holders
    "hyperball": dict(muon_hyperball=True, **VR),
}
"""Run -> its settings beside the offload ones (cautious decay: the update reads the masters)."""


def _bf16_with_and_without_master_offload(spec_kwargs: dict) -> dict:
    """Train the bf16 model with the momentum offloaded, then with the momentum and the
    masters, in each of :data:`MASTER_OFFLOAD_MODES`; report each run, where the masters
    were after it, and how
    often Megatron's master -> model copy rounded the pool on the host (the step writes
    the model's parameters from the masters staged on the device instead)."""
    from megatron_muon.state import OffloadedMasters

    rounded_on_host = []
    in_model_dtype = OffloadedMasters.in_model_dtype
    OffloadedMasters.in_model_dtype = lambda self, dtype: (rounded_on_host.append(dtype), in_model_dtype(self, dtype))[1]
    spec = M.TinyModelSpec(bf16=True, **spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, 3)
    out = {}
    runs = {}
    for mode, settings in MASTER_OFFLOAD_MODES.items():
        runs[f"momentum-{mode}"] = dict(OFFLOAD, muon_chunk_numel=3000, **settings)
        runs[f"masters-{mode}"] = dict(OFFLOAD_MASTERS, **settings)
    for name, overrides in runs.items():
        rounded_on_host.clear()
        chunks, model, opt, sched = build(spec, **overrides)
        train_steps(model, opt, sched, spec, batches)
        out[name] = dict(state=M.gather_canonical_state(chunks), optimizer=M.gather_canonical_optimizer_state(model, opt))
        masters = [o.masters_offload for o in opt.muon_optimizers]
        out[name]["facts"] = dict(
            offloaded=[m is not None for m in masters],
            in_pool=all(m.in_pool() for m in masters if m is not None),
            pool_bytes=sum(m.pool_bytes for m in masters if m is not None),
            muon_master_bytes=sum(s.numel() * 4 for o in opt.muon_optimizers for s in o.muon.masters if s is not None),
            clipped=bool(opt.muon_optimizers[0].qk_clip.last_max_logits.max() > QK["qk_clip_threshold"]),
            rounded_on_host=len(rounded_on_host),
            staged_idle=sum(m.staging.device_bytes for m in masters if m is not None),
            staged_peak=sum(m.staging.peak_device_bytes for m in masters if m is not None),
            two_chunks=sum(2 * max(sum(e - s for _, s, e in r) for r in m.staging.ranges) * 4 for m in masters if m),
        )
    OffloadedMasters.in_model_dtype = in_model_dtype
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,layout,model", LAYOUTS)
def test_offloaded_masters_change_nothing(world, layout, model):
    """Master offload moves where the update happens, not what it is: the bf16 run with
    the momentum and the fp32 masters on the CPU equals, bit for bit, the run with the
    momentum alone offloaded (which the fp32 tests above check against the reference)."""
    spec = dict(DENSE if model == "dense" else MOE, extra=QK)
    results = run_distributed(_bf16_with_and_without_master_offload, world, spec, timeout_s=800, **layout)
    for mode in MASTER_OFFLOAD_MODES:
        for r in results:
            facts = r[f"masters-{mode}"]["facts"]
            assert all(facts["offloaded"]) and facts["in_pool"], facts
            assert facts["pool_bytes"] == facts["muon_master_bytes"] > 0, facts
            assert facts["rounded_on_host"] == 0, facts  # the step wrote the model's parameters
            # staged on the device during the step: two chunks' masters at most, none after it
            assert facts["staged_idle"] == 0 and 0 < facts["staged_peak"] <= facts["two_chunks"] < facts["pool_bytes"]
            assert not any(r[f"momentum-{mode}"]["facts"]["offloaded"])
        assert results[0][f"momentum-{mode}"]["facts"]["clipped"], "QK-Clip did not act; lower the threshold"
        for part in ("state", "optimizer"):
            momentum, masters = (M.merge_canonical_states([r[f"{n}-{mode}"][part] for r in results])
                                 for n in ("momentum", "masters"))
            assert momentum.keys() == masters.keys()
            for key in momentum:
                assert torch.equal(momentum[key], masters[key]), f"{mode}: {part} {key} changed with the masters offloaded"


# ---------------------------------------------------------------------------------------
# Checkpoints: the second moments reshard, and offload on/off is invisible to them
# ---------------------------------------------------------------------------------------
STEPS_BEFORE, STEPS_AFTER = 3, 2


def _offload_facts(opt) -> dict:
    """Where the Muon momentum lives now (between steps)."""
    states = [o.muon.shard_states for o in opt.muon_optimizers]
    return dict(
        device_bytes=sum(s.device_bytes for s in states),
        pool_bytes=sum(s.pool_bytes for s in states),
        momentum_in_pool=all(
            not s.offload
            or all(
                s.state[m]["momentum_buffer"].data_ptr() == v.data_ptr()
                for m, v in zip(s.masters, s.views["momentum_buffer"])
                if m is not None
            )
            for s in states
        ),
        masters_offloaded=any(o.masters_offload is not None for o in opt.muon_optimizers),
        masters_in_pool=all(o.masters_offload.in_pool() for o in opt.muon_optimizers if o.masters_offload),
    )


def _save_then_continue(spec_kwargs, ckpt_dir, overrides):
    from megatron_muon.checkpoint import save_checkpoint

    spec = M.TinyModelSpec(**spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, STEPS_BEFORE + STEPS_AFTER)
    chunks, model, opt, sched = build(spec, **overrides)
    train_steps(model, opt, sched, spec, batches[:STEPS_BEFORE])
    saved = M.gather_canonical_optimizer_state(model, opt)
    save_checkpoint(ckpt_dir, model, opt)
    facts = _offload_facts(opt)
    train_steps(model, opt, sched, spec, batches[STEPS_BEFORE:])
    return dict(state=saved, final=M.gather_canonical_state(chunks), facts=facts)


def _load_then_continue(spec_kwargs, ckpt_dir, overrides):
    from megatron_muon.checkpoint import load_checkpoint

    spec = M.TinyModelSpec(**spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, STEPS_BEFORE + STEPS_AFTER)
    chunks, model, opt, sched = build(spec, **overrides)
    load_checkpoint(ckpt_dir, model, opt)
    facts = _offload_facts(opt)
    loaded = M.gather_canonical_optimizer_state(model, opt)
    train_steps(model, opt, sched, spec, batches[STEPS_BEFORE:])
    return dict(state=loaded, final=M.gather_canonical_state(chunks), facts=facts)


VR_ON = dict(muon_variance_reduction=0.9, muon_cautious_weight_decay=True)
CHECKPOINTS = [
    # offload on, DP2xTP2 -> offload off, DP2 (and a different owner for every matrix)
    pytest.param(dict(kind="gqa"), (4, dict(tp=2)), dict(VR_ON, muon_cpu_offload=True), (2, {}), VR_ON,
                 id="TP2xDP2-offload-to-DP2"),
    # offload off, EP2 -> offload on, DP2xEP2
    pytest.param(MOE, (2, dict(ep=2)), VR_ON, (4, dict(ep=2)), dict(VR_ON, muon_cpu_offload=True),
                 id="EP2-to-DP2xEP2-offload"),
    # bf16: masters offloaded -> masters on the device (the momentum offloaded in both, so
    # that the resumed run is bit for bit the uninterrupted one), and back
    pytest.param(dict(kind="gqa", bf16=True), (4, dict(tp=2)), dict(VR_ON, **OFFLOAD_MASTERS), (4, dict(tp=2)),
                 dict(VR_ON, **OFFLOAD), id="bf16-TP2xDP2-masters-offload-to-momentum-offload"),
    pytest.param(dict(MOE, bf16=True), (4, dict(ep=2)), dict(VR_ON, **OFFLOAD), (4, dict(ep=2)),
                 dict(VR_ON, **OFFLOAD_MASTERS), id="bf16-DP2xEP2-momentum-offload-to-masters-offload",
                 marks=pytest.mark.slow),  # the fast tier keeps the TP2 direction (its budget: 3 min)
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,before,before_cfg,after,after_cfg", CHECKPOINTS)
def test_second_moments_and_offload_survive_checkpoints(tmp_path, model, before, before_cfg, after, after_cfg):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_then_continue, before[0], model, ckpt, before_cfg, timeout_s=600, **before[1])
    loaded = run_distributed(_load_then_continue, after[0], model, ckpt, after_cfg, timeout_s=600, **after[1])
    state_before = M.merge_canonical_states([r["state"] for r in saved])
    state_after = M.merge_canonical_states([r["state"] for r in loaded])
    assert state_before.keys() == state_after.keys()
    moments = [v for k, v in state_before.items() if ".second_moment." in k]
    assert moments and all(bool((m > 0).all()) for m in moments), "second moments missing or not positive"
    for key in state_before:
        assert torch.equal(state_before[key], state_after[key]), f"{key} changed across save/load"
    for results, cfg in ((saved, before_cfg), (loaded, after_cfg)):
        for r in results:
            assert r["facts"]["momentum_in_pool"]
            assert r["facts"]["device_bytes"] == 0
            assert (r["facts"]["pool_bytes"] > 0) == bool(cfg.get("muon_cpu_offload"))
            assert r["facts"]["masters_offloaded"] == bool(cfg.get("optimizer_cpu_offload"))
            assert r["facts"]["masters_in_pool"]
    final_before = M.merge_canonical_states([r["final"] for r in saved])
    final_after = M.merge_canonical_states([r["final"] for r in loaded])
    # In the same layout bit for bit. In another, the gradients are summed in another order
    # and cautious weight decay's mask flips where update * w is within rounding of zero
    # (TP2xDP2 -> DP2: 6.1e-6 on an AVX-512 Xeon's own kernels, 3.9e-7 with MKL's AVX2 path).
    tolerance = 0.0 if before == after else 5e-5
    err, key = max_rel_err(final_after, final_before, "fro")
    assert err <= tolerance, f"after resuming, {key} differs from the uninterrupted run by {err:.2e}"


# ---------------------------------------------------------------------------------------
# Offload in every TP mode, and what stays on the device
# ---------------------------------------------------------------------------------------
TP_MODES = {
    "blockwise": dict(muon_tp_mode="blockwise"),
    "blockwise-offload": dict(muon_tp_mode="blockwise", muon_cpu_offload=True, muon_chunk_numel=3000),
    "duplicated": dict(muon_tp_mode="duplicated"),
    "duplicated-offload": dict(muon_tp_mode="duplicated", muon_cpu_offload=True, muon_chunk_numel=3000),
    "duplicated-vr": dict(muon_tp_mode="duplicated", **VR),
}


def _tp_modes_and_residency(spec_kwargs):
    """Train every TP-mode variant; then measure where the offloaded momentum lives."""
    out = train(spec_kwargs, TP_MODES)
    spec = M.TinyModelSpec(**spec_kwargs)
    chunks, model, opt, sched = build(spec, muon_cpu_offload=True, muon_chunk_numel=3000)
    peaks = []
    for tokens in M.synthetic_batches(spec, GBS, 2):
        M.train_step(model, opt, tokens, MBS, spec)
        for o in opt.muon_optimizers:
            states = o.muon.shard_states
            chunk_bytes = max(sum(e - s for _, s, e in msg.momentum) for msg in o.muon.messages) * 4
            peaks.append((states.peak_device_bytes, chunk_bytes, states.pool_bytes, states.device_bytes))
    out["residency"] = peaks
    return out


@pytest.mark.timeout(900)
def test_offload_in_every_tp_mode(references):
    results = run_distributed(_tp_modes_and_residency, 4, DENSE, timeout_s=800, tp=2)
    merged = {name: M.merge_canonical_states([r[name]["state"] for r in results]) for name in TP_MODES}
    for mode in ("blockwise", "duplicated"):
        err, key = max_rel_err(merged[f"{mode}-offload"], merged[mode], "fro")
        assert err <= 1e-5, f"{mode}: offload changes {key} by {err:.2e}"
    # duplicated is exact: it matches the reference, with and without variance reduction.
    for name, ref in (("duplicated", "plain"), ("duplicated-vr", "vr")):
        err, key = max_rel_err(merged[name], M.merge_canonical_states([references["dense"][ref][1]]), "fro")
        assert err <= 1e-5, f"{name}: {key} differs from the reference by {err:.2e}"
    for r in results:
        for peak, chunk_bytes, pool_bytes, idle in r["residency"]:
            assert idle == 0, "momentum left on the device after the step"
            assert 0 < peak <= chunk_bytes < pool_bytes, (peak, chunk_bytes, pool_bytes)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_variance_reduction_switched_on_or_off_at_a_checkpoint(tmp_path):
    """Saved with it, loaded without (the second moments are left unused), and the reverse
    (they start at zero, as in a fresh run); muon-to-adam conversion drops them."""
    from megatron_muon.megatron_lm import convert

    with_vr, without = str(tmp_path / "with_vr"), str(tmp_path / "without")
    saved = run_distributed(_save_then_continue, 2, DENSE, with_vr, VR, timeout_s=600)
    loaded = run_distributed(_load_then_continue, 2, DENSE, with_vr, {}, timeout_s=600)
    before = M.merge_canonical_states([r["state"] for r in saved])
    after = M.merge_canonical_states([r["state"] for r in loaded])
    assert set(after) == {k for k in before if ".second_moment." not in k}
    for key in after:
        assert torch.equal(before[key], after[key]), key

    run_distributed(_save_then_continue, 2, DENSE, without, {}, timeout_s=600)
    loaded = run_distributed(_load_then_continue, 2, DENSE, without, VR, timeout_s=600)
    state = M.merge_canonical_states([r["state"] for r in loaded])
    moments = [v for k, v in state.items() if ".second_moment." in k]
    assert moments and all(bool((m == 0).all()) for m in moments)

    adam = str(tmp_path / "adam")
    run_distributed(convert.muon_to_adam, 1, with_vr, adam, timeout_s=300)
    keys = run_distributed(_checkpoint_keys, 1, adam, timeout_s=300)[0]
    assert keys and not any(".second_moment." in k for k in keys)


def _checkpoint_keys(root: str) -> list:
    """The tensor keys of the checkpoint a converter wrote into ``root`` (read in a rank:
    reading starts a process group, which the test process must not hold)."""
    from megatron_muon.megatron_lm import convert

    return sorted(convert.read_checkpoint(convert.resolve_source(root)).tensors)
