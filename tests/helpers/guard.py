"""The refactor guard: fingerprints of a few short training runs, to hold a restructured
step bitwise to the code before it (``tests/dist/test_refactor_guard.py``).

Every run trains a tiny Megatron-core model for three steps and reports, merged over its
ranks into full tensors (so the fingerprint does not depend on how state is sharded): the
parameters, every optimizer state tensor in model coordinates (fp32 masters, Muon
momentum, AdamW moments, variance reduction's second moments) and the losses. A tensor's
fingerprint is the SHA-256 of its bytes, beside its float64 sum and absolute sum (these
only say how far a changed tensor moved).
"""

from __future__ import annotations

import hashlib
from typing import Dict, List

import torch

from megatron_muon.testing import models as M
from tests.helpers.training import GBS, MASTER_OFFLOAD, MBS, build

QK = dict(qk_clip=True, qk_clip_threshold=0.04)  # low: heads are clipped every step
VR = dict(muon_variance_reduction=0.9)
FREE_LINKS = dict(muon_ns_intra_node_flops_per_byte=0.0, muon_ns_inter_node_flops_per_byte=0.0)

CHUNKS = dict(muon_chunk_numel=3000)
OFFLOAD = dict(muon_cpu_offload=True, **CHUNKS)
CAUTIOUS = dict(muon_cautious_weight_decay=True)
GQA_QK = dict(kind="gqa", extra=QK)
SPLIT_MODEL = dict(kind="gqa", num_layers=1, ffn_hidden_size=512)

# (layout name) -> (world size, run_distributed layout, {run name: (model spec, optimizer overrides)})
RUNS = {
    "DP2xTP2": (
        4,
        dict(tp=2),
        {
            "gqa_qk": (GQA_QK, {}),
            "gqa_qk_chunks": (GQA_QK, CHUNKS),
            "gqa_qk_offload": (GQA_QK, OFFLOAD),
            "gqa_qk_vr": (GQA_QK, VR),
            "gqa_qk_cautious": (GQA_QK, CAUTIOUS),
            "gqa_qk_vr_cautious_chunks": (GQA_QK, dict(VR, **CAUTIOUS, **CHUNKS)),
            "gqa_qk_vr_cautious_offload": (GQA_QK, dict(VR, **CAUTIOUS, **OFFLOAD)),
            "gqa_megatron_layout": (dict(kind="gqa"), dict(muon_buffer_layout="megatron", **CHUNKS)),
            "gqa_duplicated_chunks": (dict(kind="gqa"), dict(muon_tp_mode="duplicated", **CHUNKS)),
            "gqa_duplicated_offload": (dict(kind="gqa"), dict(muon_tp_mode="duplicated", **OFFLOAD)),
            "gqa_blockwise": (dict(kind="gqa"), dict(muon_tp_mode="blockwise")),
            "gqa_gram_head_glu": (
                dict(kind="gqa"),
                dict(muon_ns_method="gram", muon_qkv_granularity="head", muon_split_glu=True),
            ),
            "mla_qk": (dict(kind="mla", extra=QK), {}),
            "bf16_cautious_chunks": (dict(GQA_QK, bf16=True), dict(CAUTIOUS, **CHUNKS)),
            "bf16_cautious_masters_offload": (dict(GQA_QK, bf16=True), dict(MASTER_OFFLOAD, **CAUTIOUS, **CHUNKS)),
        },
    ),
    "DP2xEP2": (
        4,
        dict(ep=2),
        {
            "moe": (dict(kind="moe"), {}),
            "moe_vr_chunks": (dict(kind="moe"), dict(VR, **CHUNKS)),
            "moe_vr_offload": (dict(kind="moe"), dict(VR, **OFFLOAD)),
            "moe_cautious": (dict(kind="moe"), CAUTIOUS),
            "moe_megatron_layout": (dict(kind="moe"), dict(muon_buffer_layout="megatron")),
            "moe_no_overlap": (dict(kind="moe"), dict(muon_overlap_expert_ns=False, **CHUNKS)),
        },
    ),
    "DP4-split": (
        4,
        dict(),
        {
            "split_ns": (SPLIT_MODEL, FREE_LINKS),
            "split_ns_vr": (SPLIT_MODEL, dict(FREE_LINKS, **VR)),
        },
    ),
    # Megatron-FSDP (recorded at 1aa3f41, before the storage backends).
    "FSDP-DP2": (
        2,
        dict(),
        {
            "fsdp_gqa_qk": (GQA_QK, dict(fsdp="optim_grads_params")),
            "fsdp_gqa_qk_vr_chunks": (GQA_QK, dict(VR, fsdp="optim_grads", **CHUNKS)),
            "fsdp_mla_qk": (dict(kind="mla", extra=QK), dict(fsdp="optim_grads_params")),
        },
    ),
    "FSDP-DP2xTP2": (
        4,
        dict(tp=2),
        {
            "fsdp_tp_gqa_qk": (GQA_QK, dict(fsdp="optim_grads_params")),
            "fsdp_tp_gqa_qk_vr_cautious": (GQA_QK, dict(VR, fsdp="optim_grads", **CAUTIOUS)),
        },
    ),
}

OFFLOAD_TWINS = {
    "gqa_qk_offload": "gqa_qk_chunks",
    "gqa_qk_vr_cautious_offload": "gqa_qk_vr_cautious_chunks",
    "gqa_duplicated_offload": "gqa_duplicated_chunks",
    "bf16_cautious_masters_offload": "bf16_cautious_chunks",
    "moe_vr_offload": "moe_vr_chunks",
}
"""Offloaded run -> the same run with the momentum (and masters) on the device. Before the
redesign the offload computed the Nesterov input as ``g + mu * buf`` (two roundings) and
the device path as ``torch.add(g, buf, alpha=mu)`` (one fused multiply-add): 28% of the
elements differed in the last bit. The momentum now has one code path whatever its
storage, so an offloaded run must equal its device twin bitwise."""


def guard_runs(layout: str) -> Dict[str, dict]:
    """In every rank: train each run of ``layout`` for three steps; this rank's pieces."""
    out = {}
    for name, (spec_kwargs, overrides) in RUNS[layout][2].items():
        spec = M.TinyModelSpec(**spec_kwargs)
        batches = M.synthetic_batches(spec, GBS, 3)
        chunks, model, opt, sched = build(spec, **overrides)
        losses = []
        for tokens in batches:
            loss, ok = M.train_step(model, opt, tokens, MBS, spec)
            assert ok, name
            sched.step(1)
            losses.append(loss)
        if overrides.get("fsdp"):
            params, optimizer = M.gather_canonical_state_of_megatron_fsdp(model, spec), fsdp_optimizer_state(model, opt)
        else:
            params, optimizer = M.gather_canonical_state(chunks), M.gather_canonical_optimizer_state(model, opt)
        out[name] = dict(params=params, optimizer=optimizer, losses=losses)
    return out


def fsdp_optimizer_state(model, opt) -> Dict[str, list]:
    """Every optimizer state tensor of a Megatron-FSDP run, whole per tensor-parallel rank
    (``optimizer.<state>.<param>.tp<rank>``, flat), all-gathered over each parameter's FSDP
    group from Megatron-FSDP's own shard index; in the ``gather_canonical_state`` form.

    It reads only what both sides of a storage refactor have: the inner optimizer's groups
    and state, keyed by the ``DTensor`` parameter (AdamW) or a flat view of its local shard
    (Muon's masters)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_muon.storage.megatron_fsdp import local_flat, shard_ranges

    states = {}
    for inner in opt.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                state = inner.optimizer.state.get(p, {})
                key = local_flat(p).data_ptr() if hasattr(p, "to_local") else p.data_ptr()
                states[key] = {n: v for n, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    tp = parallel_state.get_tensor_model_parallel_rank()
    out: Dict[str, list] = {}
    for chunk in model:
        names = chunk.param_and_grad_buffer.param_to_name
        for param, ranges, dp_rank, group in shard_ranges(chunk):
            local = local_flat(param)
            mine = states.get(local.data_ptr(), {}) if local.numel() else {}
            every = [None] * group.size()
            dist.all_gather_object(every, sorted(mine), group=group)
            for state_name in sorted(set().union(*every)):
                piece = torch.zeros(max(e - s for s, e in ranges), dtype=torch.float32)
                if state_name in mine:
                    piece[: local.numel()] = local_flat(mine[state_name]).float()
                pieces = [torch.empty_like(piece) for _ in ranges]
                dist.all_gather(pieces, piece, group=group)
                full = torch.zeros(param.orig_param.numel())
                for (s, e), got in zip(ranges, pieces):
                    full[s:e] = got[: e - s]
                if dp_rank == 0:
                    key = f"optimizer.{state_name}.{names[param.orig_param]}.tp{tp}"
                    out[key] = [(((full.numel(),), (slice(0, full.numel()),)), full)]
    return out


def fingerprint(tensor: torch.Tensor) -> List:
    """[sha256 of the bytes, float64 sum, float64 absolute sum] of an fp32 tensor."""
    t = tensor.detach().to(torch.float32).contiguous()
    digest = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return [digest, float(t.double().sum()), float(t.double().abs().sum())]


def fingerprints(results: List[dict]) -> Dict[str, Dict[str, List]]:
    """run name -> {tensor key: fingerprint}, from every rank's ``guard_runs`` result."""
    out = {}
    for name in results[0]:
        merged = M.merge_canonical_states([r[name]["params"] for r in results])
        merged.update(M.merge_canonical_states([r[name]["optimizer"] for r in results]))
        out[name] = {key: fingerprint(value) for key, value in sorted(merged.items())}
        out[name]["losses"] = [float.hex(x) for x in results[0][name]["losses"]]
    return out
