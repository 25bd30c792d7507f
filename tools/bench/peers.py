"""The optimizers we compare, built the same way on the same model, and how we measure them.

Peers (all on a bf16 Megatron-core GPTModel with fp32 master weights, Megatron DDP with
the distributed-optimizer buffer layout, the same learning rate, weight decay and
clipping):

* ``megatron_adamw`` - Megatron-core's ``DistributedOptimizer`` with AdamW (the baseline);
* ``megatron_muon_<mode>`` - Megatron-core's own Muon (``optimizer="muon"``, the
  layer-wise distributed optimizer, emerging-optimizers' ``TensorParallelMuon``) in its
  TP modes ``blockwise``, ``duplicated`` and ``distributed``. It needs its own DDP buffer
  layout (``LayerWiseDistributedOptimizer.compute_full_param_layout``) and ``bf16=True``.
  We set its Newton–Schulz coefficients to ``"simple"`` (Keller Jordan's, the same as our
  default ``"quintic"``) so both run the same iteration;
* ``ours_<mode>`` - ``megatron_muon.get_muon_optimizer`` in its TP modes ``exact``,
  ``blockwise`` and ``duplicated``; ``ours_exact_offload`` is exact with
  ``muon_cpu_offload`` (the momentum in a CPU pool, streamed to the device per chunk) and
  Megatron's ``optimizer_cpu_offload`` (the Muon matrices' fp32 masters in a CPU pool);
  ``ours_exact_standard`` runs standard Newton–Schulz on every matrix (the iteration
  Megatron-core's Muon runs; the default, ``muon_ns_method='auto'``, takes Gram NS on a GPU
  where the aspect ratio favours it); ``ours_exact_one_chunk`` runs the whole step as one
  pipeline chunk (``muon_chunk_numel`` above the model's size), so every matrix of a shape
  is in one Newton–Schulz stack: on one GPU, the default's chunks against the fewest
  kernel launches, at the cost of one chunk's buffers for the whole model;
* ``megatron_adamw_fsdp`` and ``ours_exact_fsdp`` - the same two on Megatron-FSDP with
  ``optim_grads_params`` (ZeRO-3: parameters, gradients and optimizer state sharded over DP).

Measurements: optimizer-state bytes per rank, parameters + gradients + optimizer state
held per rank (``held_bytes``), collective bytes (``count_traffic``), and
the gradient each rank contributed before DDP reduced it (``capture_local_grads``), from
which the parent rebuilds every full gradient matrix for the orthogonalization error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

PEERS = (
    "megatron_adamw",
    "megatron_muon_blockwise",
    "megatron_muon_duplicated",
    "megatron_muon_distributed",
    "ours_exact",
    "ours_blockwise",
    "ours_duplicated",
    "ours_exact_offload",
    "ours_exact_standard",
    "ours_exact_one_chunk",
    "ours_exact_megatron_layout",
    "megatron_adamw_fsdp",
    "ours_exact_fsdp",
)
BASELINE = "megatron_adamw"

LABELS = {
    "megatron_adamw": "Megatron DistOpt + AdamW",
    "megatron_muon_blockwise": "Megatron Muon, blockwise",
    "megatron_muon_duplicated": "Megatron Muon, duplicated",
    "megatron_muon_distributed": "Megatron Muon, distributed",
    "ours_exact": "megatron_muon, exact",
    "ours_blockwise": "megatron_muon, blockwise",
    "ours_duplicated": "megatron_muon, duplicated",
    "ours_exact_offload": "megatron_muon, exact + CPU offload",
    "ours_exact_standard": "megatron_muon, exact, standard NS on every matrix",
    "ours_exact_one_chunk": "megatron_muon, exact, the whole step as one chunk",
    "ours_exact_megatron_layout": "megatron_muon, exact, Megatron's byte-level buffers",
    "megatron_adamw_fsdp": "Megatron-FSDP + AdamW",
    "ours_exact_fsdp": "megatron_muon, exact, on Megatron-FSDP",
}
ONE_CHUNK = 2**62
"""``muon_chunk_numel`` of ``ours_exact_one_chunk``: more than any model has."""
FSDP_STRATEGY = "optim_grads_params"
"""Megatron-FSDP peers shard parameters, gradients and optimizer state (ZeRO-3)."""


@dataclass(frozen=True)
class Hyper:
    """The settings every peer gets."""

    lr: float = 0.02
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    momentum: float = 0.95
    chunk_numel: Optional[int] = None
    """Our pipeline's ``muon_chunk_numel`` (None: MuonConfig's default)."""


# One step from a known state whose update is exactly -lr * scale * NS(grad).
PROBE = Hyper(lr=1.0, weight_decay=0.0, clip_grad=0.0, momentum=0.0)


def have_megatron_muon() -> bool:
    """Megatron-core's Muon needs the emerging-optimizers package."""
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError:
        return False
    return True


def is_muon_peer(name: str) -> bool:
    return not name.startswith("megatron_adamw")


def is_fsdp_peer(name: str) -> bool:
    return name.endswith("_fsdp")


def _tp_mode(name: str) -> str:
    return name.split("_")[1] if name.startswith("ours_") else name.rsplit("_", 1)[1]


def _scheduler(optimizer, hyper: Hyper):
    """Megatron-LM's scheduler at a constant rate (it also applies the no-decay groups)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=hyper.lr,
        max_lr=hyper.lr,
        min_lr=hyper.lr,
        lr_warmup_steps=0,
        lr_decay_steps=10**6,
        lr_decay_style="constant",
        start_wd=hyper.weight_decay,
        end_wd=hyper.weight_decay,
        wd_incr_steps=10**6,
        wd_incr_style="constant",
    )


def build(name: str, spec, hyper: Hyper) -> Tuple[list, list, Any, Any]:
    """``(chunks, ddp_model, optimizer, scheduler)`` of peer ``name`` on ``spec``, from the
    layout-independent canonical weights (so every peer starts from the same model)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_muon import MuonConfig, get_muon_optimizer
    from megatron_muon.testing import models as M

    chunks = M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=0)
    common = dict(
        lr=hyper.lr,
        min_lr=hyper.lr,
        weight_decay=hyper.weight_decay,
        clip_grad=hyper.clip_grad,
        bf16=True,
        params_dtype=torch.bfloat16,
        adam_beta1=0.9,
        adam_beta2=0.95,
    )
    if name.startswith("megatron_muon"):
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer.layer_wise_optimizer import (
            LayerWiseDistributedOptimizer,
            tag_params_for_buffer_routing,
        )

        tag_params_for_buffer_routing(chunks)
        params = [p for c in chunks for p in c.parameters()]
        # The same DDP settings as wrap_ddp, so the layout matches the buffers it builds.
        layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
            params,
            None,
            parallel_state.get_data_parallel_world_size(),
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        )
        model = M.wrap_ddp(chunks, chunks[0].config, full_param_layout=layout)
        cfg = OptimizerConfig(
            optimizer="muon",
            use_distributed_optimizer=True,
            use_layer_wise_distributed_optimizer=True,
            muon_tp_mode=_tp_mode(name),
            muon_momentum=hyper.momentum,
            muon_nesterov=True,
            muon_coefficient_type="simple",
            muon_num_ns_steps=5,
            muon_split_qkv=True,
            **common,
        )
        opt = get_megatron_optimizer(cfg, model)
    elif name.startswith("ours"):
        layout = "megatron" if name.endswith("_megatron_layout") else "owner_aligned"
        chunking = {} if hyper.chunk_numel is None else dict(muon_chunk_numel=hyper.chunk_numel)
        offload = name.endswith("_offload")
        if name.endswith("_standard"):
            chunking["muon_ns_method"] = "standard"
        if name.endswith("_one_chunk"):
            chunking["muon_chunk_numel"] = ONE_CHUNK
        cfg = MuonConfig(
            muon_tp_mode=_tp_mode(name),
            muon_momentum=hyper.momentum,
            muon_buffer_layout=layout,
            muon_cpu_offload=offload,
            optimizer_cpu_offload=offload,
            optimizer_offload_fraction=1.0,
            **chunking,
            **common,
        )
        if is_fsdp_peer(name):
            model = M.wrap_megatron_fsdp(chunks, chunks[0].config, FSDP_STRATEGY)
        else:
            model = M.wrap_ddp(chunks, chunks[0].config, muon_config=cfg)
        opt = get_muon_optimizer(cfg, model)
    elif name == "megatron_adamw_fsdp":
        model = M.wrap_megatron_fsdp(chunks, chunks[0].config, FSDP_STRATEGY)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, **common), model)
    elif name == BASELINE:
        model = M.wrap_ddp(chunks, chunks[0].config)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, **common), model)
    else:
        raise ValueError(f"unknown peer {name!r}; use one of {PEERS}")
    return chunks, model, opt, _scheduler(opt, hyper)


# ---------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------


def _leaf_optimizers(opt) -> Iterator[Any]:
    if hasattr(opt, "chained_optimizers"):
        for child in opt.chained_optimizers:
            yield from _leaf_optimizers(child)
    else:
        yield opt


def optimizer_state_bytes(opt) -> Dict[str, int]:
    """Bytes of optimizer state tensors and fp32 master weights held by this rank.

    Every Megatron optimizer (and ours) keeps its masters as the params of its inner torch
    optimizer; on a bf16 model every fp32 one is a master copy. Shared storage counts once.
    """
    seen = set()
    out = {"state": 0, "master": 0}

    def add(kind: str, t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            out[kind] += t.numel() * t.element_size()

    for leaf in _leaf_optimizers(opt):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p.dtype == torch.float32:
                    add("master", _local(p))
        for state in inner.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    add("state", _local(value))
    out["total"] = out["state"] + out["master"]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a Megatron-FSDP ``DTensor``'s local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes(model, opt) -> Dict[str, int]:
    """What this rank holds between steps: model parameters (the compute weights: full under
    DDP, this rank's shard under Megatron-FSDP ``optim_grads_params``), gradients (DDP's grad
    buffer, Megatron-FSDP's main-grad shards) and optimizer state (fp32 masters + moments,
    :func:`optimizer_state_bytes`)."""
    from megatron_muon.storage.megatron_fsdp import is_megatron_fsdp

    out = dict(params=0, grads=0)
    for chunk in model:
        if is_megatron_fsdp(chunk):
            for group in chunk.param_and_grad_buffer.parameter_groups:
                weights, grads = group.model_weight_buffer, group.main_grad_buffer
                out["params"] += _nbytes(getattr(weights, "data", None))
                out["grads"] += _nbytes(getattr(grads, "data", None))
        else:
            for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
                params = buffer.param_data
                out["params"] += _nbytes(params) if params is not None else sum(_nbytes(p) for p in buffer.params)
                out["grads"] += _nbytes(buffer.grad_data)
    out["optimizer"] = optimizer_state_bytes(opt)["total"]
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def muon_state_residency(opt) -> Optional[Dict[str, int]]:
    """Where this rank's Muon-matrix optimizer state (momentum, variance reduction's second
    moments, the fp32 masters of a bf16/fp16 model) lives, in bytes, for megatron_muon
    peers (None for the others):

    * ``device_idle``: on the compute device between steps (now);
    * ``device_step_peak``: the most on the compute device during the last step (with
      offload, the staging buffers' peak: one chunk's momentum, two chunks' offloaded
      masters; summed over the dense and expert optimizers);
    * ``offloaded``: in the CPU offload pools (and CPU-kept second moments);
    * ``largest_chunk``: one pipeline chunk's momentum on this rank;
    * ``staging_bound``: the most the offload stages on the device at once: one chunk's
      offloaded states and, with the masters offloaded, two chunks' masters.

    On a CPU-only machine the compute device is the CPU as well: what counts as
    "device" is every such tensor that is not in the offload pool, i.e. exactly what
    would be on the accelerator on a GPU machine."""
    from megatron_muon.state import MOMENTUM

    muon = getattr(opt, "muon_optimizers", None)
    if muon is None:
        return None
    out = dict(device_idle=0, device_step_peak=0, offloaded=0, largest_chunk=0, staging_bound=0)
    for o in muon:
        if o.masters_offload is None:
            master_bytes = sum(m.numel() * m.element_size() for m in o.storage.float16_masters())
            out["device_idle"] += master_bytes
            out["device_step_peak"] += master_bytes
        else:  # between steps only the shared one-element placeholder; in a step, two chunks' staged
            out["offloaded"] += o.masters_offload.pool_bytes
            out["device_idle"] += o.masters_offload.staging.device_bytes
            out["device_step_peak"] += o.masters_offload.staging.peak_device_bytes
            ranges = o.masters_offload.staging.ranges
            out["staging_bound"] += 2 * max((sum(e - s for _, s, e in r) for r in ranges), default=0) * 4
        states = o.muon.shard_states
        momentum = [states.state[m].get(MOMENTUM) for m in states.masters if m is not None]
        momentum_bytes = sum(t.numel() * t.element_size() for t in momentum if t is not None)
        moments = [t for values in o.muon.owner_states.values.values() for t in values.values()]
        moment_bytes = sum(t.numel() * t.element_size() for t in moments)
        chunk = max((sum(e - s for _, s, e in msg.momentum) for msg in o.muon.messages), default=0) * 4
        out["largest_chunk"] += chunk
        if not states.offload:
            out["device_idle"] += momentum_bytes + moment_bytes
            out["device_step_peak"] += momentum_bytes + moment_bytes
        else:
            views = [v for v in states.views[MOMENTUM] if v is not None]
            in_pool = all(t.data_ptr() == v.data_ptr() for t, v in zip(momentum, views))
            out["device_idle"] += states.device_bytes + (0 if in_pool else momentum_bytes)
            out["device_step_peak"] += states.peak_device_bytes
            out["staging_bound"] += chunk * len(states.names)
            out["offloaded"] += states.pool_bytes + moment_bytes
    return out


# ---------------------------------------------------------------------------------------
# Traffic
# ---------------------------------------------------------------------------------------


def count_traffic():
    """Every collective's bytes, Megatron's Muon included: its duplicated mode gathers TP
    shards and its layer-wise optimizer gathers parameters with the list form of
    ``torch.distributed.all_gather``, which ``count_collectives`` counts too."""
    from megatron_muon.testing.traffic import count_collectives

    return count_collectives()


# ---------------------------------------------------------------------------------------
# Gradients before DDP's reduction
# ---------------------------------------------------------------------------------------


def matrix_params(chunk: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """The weights every Muon peer orthogonalizes: 2-D, not embedding / output layer."""
    return {
        n: p for n, p in chunk.named_parameters() if p.dim() == 2 and "embedding" not in n and "output_layer" not in n
    }


@contextlib.contextmanager
def capture_local_grads(params: Dict[str, torch.nn.Parameter]) -> Iterator[Dict[str, torch.Tensor]]:
    """Copy each param's ``main_grad`` just before DDP reduces it (Megatron's
    ``finalize_model_grads``). The sum over data-parallel ranks of these copies is the
    full gradient up to a positive factor, whatever buffer layout a peer uses; the polar
    factor does not depend on that factor."""
    import megatron.core.distributed as mcd

    captured: Dict[str, torch.Tensor] = {}
    original = mcd.finalize_model_grads

    def finalize(*args, **kwargs):
        for name, p in params.items():
            captured[name] = p.main_grad.detach().float().cpu().clone()
        return original(*args, **kwargs)

    mcd.finalize_model_grads = finalize
    try:
        yield captured
    finally:
        mcd.finalize_model_grads = original


def attention_dims(config) -> Dict[str, int]:
    """The TransformerConfig fields that decide a fused QKV weight's Q/K/V split."""
    return dict(
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
    )


def logical_parts(name: str, full: torch.Tensor, dims: Dict[str, int]) -> Dict[str, torch.Tensor]:
    """The Q, K, V matrices of a full fused QKV weight, split by the single-process
    reference (``megatron_muon.reference.logical_matrices``, whole parts, as every peer
    splits it); any other weight is one matrix."""
    from types import SimpleNamespace

    from megatron_muon import MuonConfig
    from megatron_muon.testing.reference import logical_matrices

    if not name.endswith("linear_qkv.weight"):
        return {name: full}
    split = MuonConfig(lr=1e-3, muon_split_qkv=True, muon_qkv_granularity="part")
    matrices = logical_matrices(name, full.shape, SimpleNamespace(**dims), split)
    return {f"{name}[{role}]": m.read(full) for role, m in zip(("q", "k", "v"), matrices)}
