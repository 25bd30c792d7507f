"""Tests of the single-process oracle ``megatron_muon.reference`` (fast, CPU)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_muon.config import MuonConfig
from megatron_muon.rule import newton_schulz
from megatron_muon.testing.reference import (
    ReferenceMuon,
    assert_partition,
    is_muon_matrix,
    logical_matrices,
    orthogonalized_update,
)


def _config(**kw) -> MuonConfig:
    base = dict(
        lr=0.05,
        weight_decay=0.1,
        clip_grad=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        muon_ns_dtype=torch.float32,
    )
    base.update(kw)
    return MuonConfig(**base)


class _Toy(torch.nn.Module):
    """Named like a Megatron model: one Muon matrix, an embedding, a norm and a bias."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(10, 12)
        self.linear_proj = torch.nn.Linear(12, 8)  # weight (8, 12): Muon; bias: AdamW, wd 0
        self.norm = torch.nn.LayerNorm(12, elementwise_affine=True, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()


def _set_grads(model, gen):
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("nesterov", [True, False])
def test_two_steps_match_hand_formula_and_torch_adamw(nesterov):
    torch.manual_seed(0)
    model = _Toy()
    cfg = _config(muon_nesterov=nesterov)
    ref = ReferenceMuon(model, cfg)
    assert [k for k, m in ref.matrices.items() if m is not None] == ["linear_proj.weight"]

    # The AdamW half against torch.optim.AdamW with Megatron's wd_mult groups.
    twin = _Toy()
    twin.load_state_dict(model.state_dict())
    adamw = torch.optim.AdamW(
        [
            {"params": [twin.embedding.word_embeddings.weight], "weight_decay": cfg.weight_decay},
            {"params": [twin.linear_proj.bias, twin.norm.weight], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        foreach=False,
    )
    w, buf, mu = model.linear_proj.weight.detach().clone(), torch.zeros(8, 12), cfg.muon_momentum
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(2):
        _set_grads(model, gen_a)
        _set_grads(twin, gen_b)
        g = model.linear_proj.weight.grad.clone()
        ref.step()
        adamw.step()
        buf = mu * buf + g
        u = g + mu * buf if nesterov else buf
        o = newton_schulz(u, steps=5, coefficients="quintic", compute_dtype=torch.float32)
        w = w * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * o * 0.2 * math.sqrt(12)
    torch.testing.assert_close(model.linear_proj.weight.detach(), w, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if name != "linear_proj.weight":
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_clipping_and_returned_norm():
    torch.manual_seed(0)
    model, twin = _Toy(), _Toy()
    twin.load_state_dict(model.state_dict())
    cfg = _config(clip_grad=0.5, weight_decay=0.0)
    ref = ReferenceMuon(model, cfg)
    adamw = torch.optim.AdamW(
        [twin.embedding.word_embeddings.weight],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=0.0,
        foreach=False,
    )
    _set_grads(model, torch.Generator().manual_seed(3))
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    twin.embedding.word_embeddings.weight.grad = model.embedding.word_embeddings.weight.grad * (0.5 / (norm + 1e-6))
    # main_grad, when present, is used instead of grad.
    model.embedding.word_embeddings.weight.main_grad = model.embedding.word_embeddings.weight.grad
    model.embedding.word_embeddings.weight.grad = None
    assert ref.step() == pytest.approx(norm, rel=1e-6)
    adamw.step()
    torch.testing.assert_close(
        model.embedding.word_embeddings.weight.detach(),
        twin.embedding.word_embeddings.weight.detach(),
        rtol=1e-6,
        atol=1e-7,
    )


def test_is_muon_matrix_rules():
    w, b = torch.zeros(4, 4), torch.zeros(4)
    cfg = _config()
    muon = lambda name, p=w, c=cfg: is_muon_matrix(name, p, c)  # noqa: E731
    assert muon("decoder.layers.0.self_attention.linear_qkv.weight")
    assert muon("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    assert muon("decoder.layers.0.mlp.experts.linear_fc2.weight7")
    assert not muon("embedding.word_embeddings.weight")
    assert not muon("embedding.position_embeddings.weight")
    assert not muon("output_layer.weight")
    assert not muon("decoder.layers.0.mlp.router.weight")
    assert not muon("decoder.final_layernorm.weight", b)
    assert not muon("decoder.layers.0.mlp.linear_fc1.bias", b)
    assert muon("decoder.layers.0.mlp.router.weight", c=_config(muon_router_optimizer="muon"))
    excl = _config(muon_exclude_patterns=("*.linear_proj.weight",))
    assert not muon("decoder.layers.1.self_attention.linear_proj.weight", c=excl)
    only = _config(muon_param_filter=lambda name, p: name == "output_layer.weight")
    assert muon("output_layer.weight", c=only) and not muon("a.linear_qkv.weight", c=only)


_TC = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=3, hidden_size=5, gated_linear_unit=True)
_QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def _row_sets(granularity):
    cfg = _config(muon_split_qkv=True, muon_qkv_granularity=granularity)
    w = torch.arange(24.0).unsqueeze(1).expand(24, 5).contiguous()  # row r holds r
    mats = logical_matrices(_QKV, w.shape, _TC, cfg)
    assert_partition(_QKV, w.shape, mats)
    out = []
    for lm in mats:
        m = lm.read(w)
        assert m.shape[1] == 5
        out.append(m[:, 0].long().tolist())
    return out


def test_qkv_split_rows():
    # nh=4, ng=2, d=3: each group is 12 rows = [q head 0, q head 1, k, v] of 3 rows each.
    q0, q1, k0, v0 = [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]
    q2, q3, k1, v1 = [12, 13, 14], [15, 16, 17], [18, 19, 20], [21, 22, 23]
    assert _row_sets("part") == [q0 + q1 + q2 + q3, k0 + k1, v0 + v1]
    assert _row_sets("group") == [q0 + q1, k0, v0, q2 + q3, k1, v1]
    assert sorted(_row_sets("head")) == sorted([q0, q1, q2, q3, k0, k1, v0, v1])
    whole = logical_matrices(_QKV, (24, 5), _TC, _config(muon_split_qkv=False))
    assert len(whole) == 1 and whole[0].read(torch.zeros(24, 5)).shape == (24, 5)


def test_split_update_is_per_part():
    cfg = _config(muon_split_qkv=True, muon_qkv_granularity="part", muon_scale_mode="shape_scaling")
    u = torch.randn(24, 5, generator=torch.Generator().manual_seed(0))
    out = orthogonalized_update(u, logical_matrices(_QKV, u.shape, _TC, cfg), cfg)
    k_rows = [6, 7, 8, 18, 19, 20]
    expect = newton_schulz(u[k_rows], compute_dtype=torch.float32) * math.sqrt(6 / 5)
    torch.testing.assert_close(out[k_rows], expect)


def test_glu_and_legacy_expert_views():
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    split = _config(muon_split_glu=True)
    w = torch.arange(8.0).unsqueeze(1).expand(8, 3)
    halves = logical_matrices(name, w.shape, _TC, split)
    assert [lm.read(w)[:, 0].tolist() for lm in halves] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(logical_matrices(name, w.shape, _TC, _config(muon_split_glu=False))) == 1
    assert len(logical_matrices(name, w.shape, SimpleNamespace(gated_linear_unit=False), split)) == 1

    E, h, ffn = 3, 4, 2
    module = SimpleNamespace(num_local_experts=E)
    w1 = torch.randn(h, E * 2 * ffn)
    w2 = torch.randn(E * ffn, h)
    m1 = logical_matrices("mlp.experts.weight1", w1.shape, _TC, _config(), module)
    m2 = logical_matrices("mlp.experts.weight2", w2.shape, _TC, _config(), module)
    for e in range(E):
        torch.testing.assert_close(m1[e].read(w1), w1.view(E, h, -1)[e].T)  # (2*ffn, h)
        torch.testing.assert_close(m2[e].read(w2), w2.view(E, -1, h)[e].T)  # (h, ffn)
    m1s = logical_matrices("mlp.experts.weight1", w1.shape, _TC, split, module)
    assert len(m1s) == 2 * E and m1s[1].read(w1).shape == (ffn, h)
    for mats, t in ((m1, w1), (m2, w2), (m1s, w1)):
        assert_partition("legacy", t.shape, mats)
    cfg = _config(muon_scale_mode="none")
    out = orthogonalized_update(w2, m2, cfg)
    torch.testing.assert_close(
        out.view(E, -1, h)[1], newton_schulz(w2.view(E, -1, h)[1], compute_dtype=torch.float32), rtol=1e-5, atol=1e-5
    )
