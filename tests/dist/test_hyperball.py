"""Muon-Hyperball (``megatron_muon.hyperball``) on real Megatron-core GPT models (CPU, gloo)
against the single-process reference's own Hyperball (``testing/reference.py``): dense GQA
with QK-Clip at DP2 x TP2 on DDP and on Megatron-FSDP and at CP2 x TP2, MoE + MLA at
EP2 x DP2; its radius saved and resharded by checkpoints; and what it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_muon.testing import models as M
from megatron_muon.testing import run_distributed
from tests.dist.test_variants import _load_then_continue, _save_then_continue
from tests.helpers.training import build, max_rel_err, reference, train

QK = dict(qk_clip=True, qk_clip_threshold=0.04)  # low: QK-Clip scales the matrices after Hyperball
HYPERBALL = dict(muon_hyperball=True)
GQA = dict(kind="gqa", extra=QK)
MOE_MLA = dict(kind="moe", mla=True, extra=QK)
DENSE_VARIANTS = {
    "hyperball": HYPERBALL,
    # a given radius (an RMS: every matrix is put on its sphere at the first step), variance reduction
    "radius_vr": dict(HYPERBALL, muon_hyperball_radius=0.05, muon_variance_reduction=0.9),
    "fsdp": dict(HYPERBALL, fsdp="optim_grads_params"),
}
ALONE = {"hyperball": HYPERBALL}
"""Hyperball alone (the dense references hold it too)."""


def _references() -> dict:
    out = {"gqa": reference(GQA, dict(DENSE_VARIANTS, plain={})), "moe": reference(MOE_MLA, ALONE)}
    out["refused"] = _refused_column_groups()
    return out


def _refused_column_groups() -> str:
    """Legacy GroupedMLP with split GLU halves: the gate and up matrices are column groups of one unit."""
    spec = M.TinyModelSpec(kind="moe", expert_layout="legacy_grouped")  # swiglu: gated fc1
    try:
        build(spec, muon_hyperball=True, muon_split_glu=True)
    except ValueError as err:
        return str(err)
    return ""


@pytest.fixture(scope="module")
def references():
    return run_distributed(_references, 1, timeout_s=400)[0]


def _check(results: list, ref: dict, variants) -> None:
    for name in variants:
        full = M.merge_canonical_states([r[name]["state"] for r in results])
        err, key = max_rel_err(full, M.merge_canonical_states([ref[name][1]]), "fro")
        assert err <= 1e-5, f"{name}: {key} differs from the reference by {err:.2e}"
        for ours, theirs in zip(results[0][name]["losses"], ref[name][0]):
            assert math.isclose(ours, theirs, rel_tol=1e-5), (name, ours, theirs)


@pytest.mark.timeout(900)
def test_dense_gqa_qk_clip_on_ddp_and_megatron_fsdp_equal_reference(references):
    """DP2 x TP2: each logical matrix's norm is reduced over its TP x DP pieces (DDP's
    owner-aligned buffers and Megatron-FSDP's shards) and matches the reference's whole-matrix
    Hyperball; the reference's Hyperball is not plain Muon."""
    results = run_distributed(train, 4, GQA, DENSE_VARIANTS, timeout_s=800, tp=2)
    _check(results, references["gqa"], DENSE_VARIANTS)
    plain = M.merge_canonical_states([references["gqa"]["plain"][1]])
    err, _ = max_rel_err(M.merge_canonical_states([references["gqa"]["hyperball"][1]]), plain, "fro")
    assert err > 1e-3, f"Hyperball did not change the reference's result ({err:.2e})"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "spec,layout,model",
    [
        # the masters sharded over the context-parallel ranks (the optimizer's DP group is DP x CP)
        pytest.param(GQA, dict(cp=2, tp=2), "gqa", id="CP2xTP2-GQA-QKClip"),
        # the expert matrices (expert-DP x expert-TP group) and the MLA parts (split per part)
        pytest.param(MOE_MLA, dict(ep=2), "moe", id="EP2xDP2-MoE-MLA"),
    ],
)
def test_other_layouts_equal_reference(references, spec, layout, model):
    results = run_distributed(train, 4, spec, ALONE, timeout_s=800, **layout)
    _check(results, references[model], ALONE)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_radius_survives_checkpoints_across_layouts(tmp_path):
    """Saved at DP2 x TP2, loaded at DP2 (other owners hold every matrix): the radii come
    back bit for bit, and the resumed run is the uninterrupted one."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_then_continue, 4, GQA, ckpt, HYPERBALL, timeout_s=600, tp=2)
    loaded = run_distributed(_load_then_continue, 2, GQA, ckpt, HYPERBALL, timeout_s=600)
    before = M.merge_canonical_states([r["state"] for r in saved])
    after = M.merge_canonical_states([r["state"] for r in loaded])
    assert before.keys() == after.keys()
    radii = [v for k, v in before.items() if ".hyperball_radius." in k]
    assert radii and all(bool((r > 0).all()) for r in radii), "radii missing or not set"
    for key in before:
        assert torch.equal(before[key], after[key]), f"{key} changed across save/load"
    final_before = M.merge_canonical_states([r["final"] for r in saved])
    final_after = M.merge_canonical_states([r["final"] for r in loaded])
    err, key = max_rel_err(final_after, final_before, "fro")
    assert err <= 1e-5, f"after resuming, {key} differs from the uninterrupted run by {err:.2e}"


def test_refused_where_it_cannot_be_exact(references):
    from megatron_muon import MuonConfig

    cases = {
        "muon_tp_mode='blockwise'": dict(muon_tp_mode="blockwise"),
        "muon_tp_mode='duplicated'": dict(muon_tp_mode="duplicated"),
        "muon_cautious_weight_decay=True": dict(muon_cautious_weight_decay=True),
        "muon_hyperball_radius=-1": dict(muon_hyperball_radius=-1.0),
    }
    for what, overrides in cases.items():
        with pytest.raises(ValueError, match="muon_hyperball") as refusal:
            MuonConfig(lr=0.01, muon_hyperball=True, **overrides)
        assert len(str(refusal.value).splitlines()) == 1, what
    with pytest.raises(ValueError, match="muon_hyperball_radius=0.1 is invalid"):
        MuonConfig(lr=0.01, muon_hyperball_radius=0.1)  # without muon_hyperball
    refused = references["refused"]
    assert "muon_hyperball=True cannot be exact" in refused and "muon_split_glu" in refused, refused
    assert len(refused.splitlines()) == 1
