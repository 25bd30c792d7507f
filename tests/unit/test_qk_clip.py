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
