"""The reference's own training loop on a real tiny Megatron model (one gloo rank): losses
fall, every parameter moves. The exactness tests compare every layout with it."""

from __future__ import annotations

import math

import torch

from megatron_muon.config import MuonConfig
from megatron_muon.testing.models import reference_train


def test_reference_train_tiny_gqa():
    from megatron_muon.testing.launcher import run_distributed
    from megatron_muon.testing.models import (
        TinyModelSpec, _seeded_global, merge_canonical_states, synthetic_batches)

    spec = TinyModelSpec()
    batch = synthetic_batches(spec, global_batch_size=4, num_steps=1)[0]
    cfg = MuonConfig(lr=0.02, weight_decay=0.01, clip_grad=1.0)
    (losses, state), = run_distributed(reference_train, 1, spec, cfg, [batch] * 3, 2, timeout_s=120)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[2] < losses[0], losses
    full = merge_canonical_states([state])
    assert any("linear_qkv" in k for k in full) and any("word_embeddings" in k for k in full)
    for key, value in full.items():  # every parameter got a gradient and moved
        assert torch.isfinite(value).all(), key
        assert not torch.equal(value, _seeded_global(key, tuple(value.shape), 0, 0.05)), key
