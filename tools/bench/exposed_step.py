"""How much of the Muon step a training iteration waits for: with the step run whole between
the backward and the next forward (``muon_step_overlap="none"``) and with each layer's
update finished just before the next forward reaches it (``"forward"``, issue 39).

The scale model (``scale_model.py``) gives, per pipeline stage, the step time of its slowest
rank ``T`` (elementwise work, then gather / Newton–Schulz / scatter pipelined over the
chunks) and the part of it only that GPU's own kernels can do, ``G`` (elementwise work and
Newton–Schulz, the multi-rank collectives inside it included). This module turns them into
the time the iteration is delayed by the step, on Megatron's 1F1B pipeline schedule:

* every stage starts its step at once, when the global part (gradient norm, clipping) is
  known: stage 0's backward ends last;
* ``e_s``, the moment stage ``s`` finishes the first micro-batch's forward of the next
  iteration, is ``max(e_{s-1}, R_s) + f`` with ``e_{-1} = 0``, ``f`` one micro-batch's
  forward on one stage and ``R_s`` what stage ``s`` must finish before that forward can end:
  its whole step ``T_s`` with ``"none"``; with ``"forward"`` its own kernels ``G_s``, or the
  step less the forward it can hide behind, ``T_s - f``, whichever is longer (the last
  layer's update is needed before that forward ends; communication travels meanwhile).
  Newton–Schulz competes with the forward for the same GPU. Two bounds: it hides nowhere
  (``idle_share`` 0), or it fills the time that forward leaves the GPU's matrix units idle,
  ``1 - MFU / NS efficiency`` of ``f`` (waits on TP and EP communication, memory-bound
  kernels); which is nearer needs a GPU to measure;
* the delay is ``e_{P-1} - P f``: what the last stage's first forward lost against an
  iteration without a step. Every later micro-batch keeps that shift.

Both modes already use the warm-up bubble (stage ``s`` waits ``s f`` for its first input
either way): what ``"forward"`` adds is the communication of the step hidden behind the
stage's own first forward. ``f`` comes from the model FLOPs at the cluster's MFU: a train
step is ``3 f (m + P - 1)`` for ``m`` micro-batches per data-parallel rank.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from tools.bench import common

MODES = ("none", "forward")


def microbatch_forward_ms(train_step_ms: float, microbatches: int, pp: int) -> float:
    """One micro-batch's forward on one stage: the train step is ``3 f (m + P - 1)``
    (forward ``f``, backward ``2 f``, the 1F1B schedule's ``P - 1`` bubble slots)."""
    return train_step_ms / (3.0 * (microbatches + pp - 1))


def ready_ms(step_ms: float, own_ms: float, forward: float, mode: str, idle_share: float = 0.0) -> float:
    """What a stage must finish before its first forward of the next iteration can end
    (module docstring: ``R_s``); ``idle_share`` of that forward can take the stage's own
    Newton–Schulz with ``"forward"``."""
    if mode == "none":
        return step_ms
    if mode == "forward":
        return max(own_ms - idle_share * forward, step_ms - forward, 0.0)
    raise ValueError(f"unknown muon_step_overlap {mode!r}; use one of {MODES}")


def exposed_ms(stages: Sequence[Dict[str, float]], forward: float, mode: str, idle_share: float = 0.0) -> float:
    """The iteration's delay by the step: ``stages[s]`` holds ``step_ms`` and ``own_ms`` of
    stage ``s``'s slowest rank."""
    end = 0.0
    for stage in stages:
        end = max(end, ready_ms(stage["step_ms"], stage["own_ms"], forward, mode, idle_share)) + forward
    return max(end - len(stages) * forward, 0.0)


def exposure(
    stages: List[Dict[str, float]], train_step_ms: float, microbatches: int, mfu: float, ns_efficiency: float
) -> Dict[str, float]:
    """The exposed milliseconds with ``"none"`` (``none_ms``) and with ``"forward"`` at both
    bounds (``forward_ms``: Newton–Schulz hides nowhere; ``forward_concurrent_ms``: it fills
    the forward's idle share), each also as a share of the train step; ``f``."""
    f = microbatch_forward_ms(train_step_ms, microbatches, len(stages))
    idle = max(1.0 - mfu / ns_efficiency, 0.0)
    out: Dict[str, float] = dict(microbatches=microbatches, microbatch_forward_ms=f, idle_share=idle)
    for key, mode, share in (
        ("none", "none", 0.0),
        ("forward", "forward", 0.0),
        ("forward_concurrent", "forward", idle),
    ):
        ms = exposed_ms(stages, f, mode, share)
        out[f"{key}_ms"] = ms
        out[f"{key}_share_of_train"] = ms / train_step_ms
    return out


def markdown(predictions: Dict[str, Dict]) -> str:
    """The table of every scenario's exposed step (ours, exact) with ``"none"`` and ``"forward"``."""
    rows = []
    for name, p in predictions.items():
        e = p["exposed"]
        rows.append(
            [
                name,
                p["layout"],
                e["microbatches"],
                e["microbatch_forward_ms"],
                p["schemes"]["ours_exact"]["step_ms"],
                e["none_ms"],
                e["forward_ms"],
                e["forward_concurrent_ms"],
                e["none_share_of_train"] * 100,
                e["forward_share_of_train"] * 100,
                e["forward_concurrent_share_of_train"] * 100,
            ]
        )
    return common.md_table(
        [
            "scenario",
            "layout",
            "micro-batches / DP rank",
            "one micro-batch forward, one stage (ms)",
            "step, slowest rank (ms)",
            "exposed, none (ms)",
            "exposed, forward, NS not concurrent (ms)",
            "exposed, forward, NS in the forward's idle share (ms)",
            "% of train step: none",
            "forward, not concurrent",
            "forward, idle share",
        ],
        rows,
    )
