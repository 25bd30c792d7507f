"""Multi-token prediction (DeepSeek-V3's MTP) on a tiny DeepSeek-V3-style Megatron-core
model (MLA, MoE, one MTP layer; CPU, gloo): the MTP layer's matrices (``eh_proj``, its
attention's MLA parts, its experts) are split, orthogonalized and QK-clipped like the main
stack's, exact against the single-process reference at EP2."""

from __future__ import annotations

import pytest

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import max_rel_err, reference, train

# qk_clip_threshold far below the tiny model's logits: every head of every layer, the MTP
# layer's included, is clipped in every step.
DEEPSEEK_V3_TINY = dict(kind="moe", mla=True, mtp_num_layers=1, extra=dict(qk_clip=True, qk_clip_threshold=0.04))
FP32 = {"fp32": {}}


@pytest.fixture(scope="module")
def mtp_reference():
    return run_distributed(reference, 1, DEEPSEEK_V3_TINY, FP32, timeout_s=300)[0]["fp32"]


LAYOUTS = [
    pytest.param(2, dict(ep=2), {}, id="EP2"),
    # The MTP layer's own norms with sequence parallelism; its eh_proj column-parallel.
    pytest.param(4, dict(tp=2, ep=2), dict(sequence_parallel=True), id="TP2xEP2-SP", marks=pytest.mark.slow),
    # The MTP layer on the last stage, which holds a copy of the word embeddings for it.
    pytest.param(4, dict(pp=2, ep=2), {}, id="PP2xEP2", marks=pytest.mark.slow),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layout,model", LAYOUTS)
def test_mla_moe_mtp_equals_reference(mtp_reference, world, layout, model):
    ref = mtp_reference
    results = run_distributed(train, world, dict(DEEPSEEK_V3_TINY, **model), FP32, timeout_s=500, **layout)
    full = M.merge_canonical_states([r["fp32"]["state"] for r in results])
    expected = M.merge_canonical_states([ref[1]])
    assert any(key.startswith("mtp.") for key in expected), sorted(expected)
    err, key = max_rel_err(full, expected, "fro")
    assert err <= 1e-5, f"{key} differs from the reference by {err:.2e}"
    computed = [n for r in results for n in r["fp32"]["computed"]]
    mtp = [n for n in computed if n.startswith(("mtp.", "ep0.mtp.", "ep1.mtp."))]
    # eh_proj whole; the MTP layer's MLA up-projections per part; its 4 experts' fc1 and fc2 once each.
    assert any("eh_proj" in n for n in mtp), mtp
    assert any("mtp_model_layer.self_attention.linear_kv_up_proj.weight[k_nope" in n for n in mtp), mtp
    experts = [n for n in mtp if "experts" in n]
    assert len(experts) == len(set(experts)) == 4 * 2, experts
    # QK-Clip measures and clips the MTP layer's heads too (on the stage that holds it).
    clip_layers = [n for r in results for n in r["fp32"]["clip_layers"]]
    assert any("mtp.layers.0.mtp_model_layer.self_attention" in n for n in clip_layers), clip_layers
