"""The router's expert bias moves only with a step that was taken.

Megatron-core updates the aux-loss-free expert bias (``--moe-router-enable-expert-bias``)
inside ``finalize_model_grads``, before the optimizer decides whether the step is skipped
(a non-finite gradient) or the rerun state machine stops the job on a NaN loss; so a skipped
step still changed the model, and a checkpoint saved when the job stops holds a bias no
step produced. Here Megatron-core's update is computed where it always was (its own code,
its collectives), kept aside, and applied after Megatron-LM's ``train_step`` returns, only
when the step was taken (``patches.EXPERT_BIAS``; their context's ``expert_bias`` is one
:class:`PendingExpertBias`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch


class PendingExpertBias:
    """The biases of the step in flight: (the model's tensor, its value after the update)."""

    def __init__(self) -> None:
        self.updates: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def apply(self) -> None:
        with torch.no_grad():
            for bias, value in self.updates:
                bias.copy_(value)
        self.updates.clear()


def _expert_biases(model) -> List[torch.Tensor]:
    return [
        module.expert_bias
        for chunk in model
        for module in chunk.modules()
        if getattr(module, "expert_bias", None) is not None
    ]


def _wrap_update_router_expert_bias(original: Callable, context: Any) -> Callable:
    pending: PendingExpertBias = context.expert_bias

    def update_router_expert_bias(model, *a, **kw):
        biases = _expert_biases(model)
        before = [b.detach().clone() for b in biases]
        original(model, *a, **kw)
        pending.updates = [(b, b.detach().clone()) for b in biases]
        with torch.no_grad():
            for bias, value in zip(biases, before):
                bias.copy_(value)

    update_router_expert_bias.__wrapped__ = original  # type: ignore[attr-defined]
    return update_router_expert_bias


def _wrap_train_step(original: Callable, context: Any) -> Callable:
    pending: PendingExpertBias = context.expert_bias

    def train_step(*a, **kw):
        pending.updates = []
        out = original(*a, **kw)
        skipped, should_exit = out[1], out[3]
        if not skipped and not should_exit:
            pending.apply()
        pending.updates = []
        return out

    train_step.__wrapped__ = original  # type: ignore[attr-defined]
    return train_step
