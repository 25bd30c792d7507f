"""QK-Clip's per-head factor, without ranks (the clipping itself is tested on real models in
``tests/dist/test_qk_clip.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.qk_clip import head_gammas


def test_only_heads_above_tau_are_clipped():
    """``tau / S_max`` above tau, 1 elsewhere, including a head whose largest logit is
    negative (``min(1, tau / S_max)`` made it negative, and its square root NaN weights: seen
    after adam-to-muon with tau 0.01)."""
    maxima = torch.tensor([-3.0, -0.0, 0.0, 0.005, 0.01, 0.02, 50.0])
    assert head_gammas(maxima, 0.01).tolist() == pytest.approx([1, 1, 1, 1, 1, 0.5, 0.0002])


@pytest.mark.parametrize(
    "threshold, alpha, message",
    [
        (-5.0, 0.5, "qk_clip_threshold must be a finite number > 0"),
        (0.0, 0.5, "qk_clip_threshold must be a finite number > 0"),
        (float("nan"), 0.5, "qk_clip_threshold must be a finite number > 0"),
        (100.0, 1.5, "qk_clip_alpha must be in \\(0, 1\\)"),
    ],
)
def test_a_threshold_or_alpha_that_cannot_clip_is_refused_before_any_step(threshold, alpha, message):
    """A threshold <= 0 would clip every head to logits of 0 (or NaN); the library path
    refuses it when the optimizer is built, as the main job does at start-up."""
    from types import SimpleNamespace

    from megatron_muon.qk_clip import QKClip

    chunk = torch.nn.Module()
    chunk.config = SimpleNamespace(
        qk_clip=True, log_max_attention_logit=False, qk_clip_threshold=threshold, qk_clip_alpha=alpha
    )
    with pytest.raises(ValueError, match=message):
        QKClip.from_model([chunk], None, None)
