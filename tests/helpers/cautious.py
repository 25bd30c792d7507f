"""Cautious weight decay checked soundly: its rule ``update * w >= 0`` is discontinuous, so
two correct implementations whose updates differ by rounding disagree on single elements
where the product is near zero. The distributed run records the mask it applied, the
single-process reference applies that mask, and the mask itself is compared with the
reference's own (few flips, all near zero)."""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_muon.testing import models as M
from tests.helpers.training import GBS, MBS, STEPS, build


def train_recording_masks(spec_kwargs: dict, overrides: dict, steps: int = STEPS) -> dict:
    """In every rank: train with ``overrides`` (cautious weight decay on) and record, per
    step, the mask the step applied, as canonical pieces (-1 where this rank holds none)."""
    import megatron_muon.rule as rule

    spec = M.TinyModelSpec(**spec_kwargs)
    chunks, model, opt, sched = build(spec, **overrides)
    masters = [
        (s.master, s.param, s.start)
        for o in opt.muon_optimizers
        for s in o.shard_map
        if s.master is not None and id(s.param) in o.muon_param_ids
    ]
    local: Dict[int, torch.Tensor] = {}
    original = rule.decay_and_update_

    def recording(master, update, lr, wd, cautious):
        if cautious:
            owner, param, start = next(
                m for m in masters if 0 <= master.data_ptr() - m[0].data_ptr() < m[0].numel() * 4
            )
            offset = start + (master.data_ptr() - owner.data_ptr()) // 4
            mask = local.setdefault(id(param), torch.full((param.numel(),), -1.0))
            mask[offset : offset + master.numel()] = ((update.to(master.device) * master) >= 0).float()
        return original(master, update, lr, wd, cautious)

    steps_out, losses = [], []
    rule.decay_and_update_ = recording
    try:
        for tokens in M.synthetic_batches(spec, GBS, steps):
            local.clear()
            loss, ok = M.train_step(model, opt, tokens, MBS, spec)
            assert ok
            sched.step(1)
            losses.append(loss)
            pieces: Dict[str, list] = {}
            for chunk in chunks:
                for st in M._sharded_tensors(chunk):
                    param, offset = M.param_region(st, chunks)
                    if id(param) in local:
                        mask = local[id(param)][offset : offset + st.data.numel()].view(st.data.shape)
                        pieces.setdefault(st.key, []).append(((tuple(st.global_shape), st.global_slice()), mask))
            steps_out.append(pieces)
    finally:
        rule.decay_and_update_ = original
    return dict(losses=losses, state=M.gather_canonical_state(chunks), masks=steps_out)


def merge_masks(per_rank: List[List[dict]]) -> List[Dict[str, torch.Tensor]]:
    """Per step, {canonical key: full mask} from every rank's pieces (each element from a
    rank that holds it)."""
    merged = []
    for step in zip(*per_rank):
        full: Dict[str, torch.Tensor] = {}
        for pieces in step:
            for key, items in pieces.items():
                for (shape, where), mask in items:
                    target = full.setdefault(key, torch.full(shape, -1.0))
                    target[where] = torch.maximum(target[where], mask.reshape(target[where].shape))
        for key, mask in full.items():
            assert bool((mask >= 0).all()), f"no rank reported part of the mask of {key}"
        merged.append(full)
    return merged


def reference_with_masks(spec_kwargs: dict, overrides: dict, masks: List[Dict[str, torch.Tensor]]):
    """The single-process reference applying the distributed run's masks (in a rank)."""
    from tests.helpers.training import muon_config

    spec = M.TinyModelSpec(**spec_kwargs)
    batches = M.synthetic_batches(spec, GBS, len(masks))
    return M.reference_train(spec, muon_config(spec, **overrides), batches, MBS, cautious_masks=masks)
