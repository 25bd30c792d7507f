"""A plain-torch core attention for Megatron layer specs that records per-head max logits.

QK-Clip needs, for every attention head, the largest pre-softmax logit ``q . k * scale``
seen in the step. Transformer-engine's attention records it in
``core_attention.current_max_attn_logits`` (when ``config.qk_clip`` or
``config.log_max_attention_logit`` is set); Megatron's local ``DotProductAttention``
records nothing and rejects the ``k_channels`` / ``v_channels`` that multi-latent
attention passes. ``RecordingDotProductAttention`` does both, without transformer-engine
and on the CPU: MHA, GQA and MLA, causal or with an explicit mask, with or without context
parallelism.

Context parallelism (``context_parallel_size`` > 1): each CP rank holds two of the
``2 * CP`` equal chunks of the sequence (chunks ``r`` and ``2 * CP - 1 - r``, Megatron's
load-balanced split, ``get_batch_on_this_cp_rank``). Keys and values are all-gathered over
the CP group (backward: reduce-scatter of their gradients), every query attends to all
gathered keys, and the causal mask compares global positions. This is the simplest exact
CP attention (no ring, whole K/V on every rank); transformer-engine's ring attention is
the one to use on GPUs.

The record is a running max over the micro-batches of a step (a ``[heads_per_partition]``
fp32 tensor); the optimizer all-reduces it over data/context-parallel ranks, uses it, and
resets it to ``None``. The logits tensor is the one softmax needs anyway; recording is
one ``amax`` over it, no second copy kept.

``TensorParallelMLASelfAttention`` is Megatron's ``MLASelfAttention`` with the two
tensor-parallel gradient errors of its local (``ColumnParallelLinear`` down-projection)
path corrected; the local layer spec uses it for multi-latent attention.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


def cp_positions(local_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_length`` tokens that CP rank ``cp_rank`` holds under
    Megatron's load-balanced split: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of
    the ``2 * cp_size`` equal chunks of the sequence."""
    if local_length % 2:
        raise ValueError(f"context parallelism: a rank's sequence length ({local_length}) must be even")
    half = local_length // 2
    return torch.cat(
        [torch.arange(c * half, (c + 1) * half, device=device) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)]
    )


class RecordingDotProductAttention(MegatronModule):
    """Core attention (softmax(q k^T * scale) v) that records per-head max logits."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ) -> None:
        super().__init__(config=config)
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise NotImplementedError("RecordingDotProductAttention supports vanilla full/causal softmax only.")
        if pg_collection is not None:
            tp_size = pg_collection.tp.size()
            self.cp_group = getattr(pg_collection, "cp", None)
        else:
            from megatron.core import parallel_state

            tp_size = parallel_state.get_tensor_model_parallel_world_size()
            self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
        if self.cp_group is not None and self.cp_group.size() == 1:
            self.cp_group = None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp_size
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp_size
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.record = bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False))
        self.current_max_attn_logits: Optional[torch.Tensor] = None

    def _record(self, scores: torch.Tensor, masked: Optional[torch.Tensor]) -> None:
        with torch.no_grad():
            s = scores.detach().float()
            if masked is not None:
                s = s.masked_fill(masked, float("-inf"))
            step_max = s.amax(dim=(0, 2, 3))
            prev = self.current_max_attn_logits
            self.current_max_attn_logits = step_max if prev is None else torch.maximum(prev, step_max)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """q ``[sq, b, np, hk]``, k ``[sk, b, ng, hk]``, v ``[sk, b, ng, hv]`` -> ``[sq, b, np*hv]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("RecordingDotProductAttention: packed sequences / attention bias")
        if self.cp_group is not None:
            key, value = (gather_from_sequence_parallel_region(t, group=self.cp_group) for t in (key, value))
            # Gathered rank by rank, the keys are in the load-balanced chunk order (0, 3, 1, 2
            # for CP2); in sequence order, the softmax and probs @ v add as without CP.
            size = self.cp_group.size()
            positions = [cp_positions(query.shape[0], r, size, key.device) for r in range(size)]
            order = torch.argsort(torch.cat(positions))
            key, value = key[order], value[order]
        repeat = query.shape[2] // key.shape[2]
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        # [b, np, sq, sk]
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        masked = attention_mask
        if self.cp_group is not None:
            if masked is None and mask_type == AttnMaskType.causal:  # this rank's queries' positions
                masked = torch.arange(sk, device=scores.device)[None, :] > positions[self.cp_group.rank()][:, None]
        elif masked is None and mask_type == AttnMaskType.causal:
            masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        if self.record and self.training:
            self._record(scores, masked)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        if self.config.sequence_parallel:
            probs = self.dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        context = torch.einsum("bnst,tbnd->sbnd", probs, value)
        return context.reshape(context.shape[0], context.shape[1], -1)


class TensorParallelMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose gradients at TP > 1 equal those at TP = 1.

    Megatron-core 0.19's MLA, built with ``ColumnParallelLinear`` down projections (the
    local spec; transformer-engine's ``TELinear`` is the only other choice it accepts),
    computes wrong gradients when tensor parallelism is on:

    1. ``k_pos_emb`` (the rope part of the key, shared by all heads) is cut out of
       ``linear_kv_down_proj``'s output after ``gather_from_tensor_model_parallel_region``,
       whose backward only *splits*. Every TP rank uses it for its own heads, so its
       gradient is a per-rank partial sum that is never reduced over TP: the rope rows of
       ``linear_kv_down_proj`` get only the owning rank's heads' share, and so does the
       input gradient of the layer (every earlier parameter is off). With or without
       sequence parallelism. (Megatron-LM issue #1699.)
    2. Without sequence parallelism the ``q_layernorm`` gradient is TP times too large:
       ``linear_q_up_proj`` (column parallel) all-reduces its input gradient, so the norm
       after it already has the full gradient on every rank, and then
       ``finalize_model_grads._allreduce_non_tensor_model_parallel_grads`` sums it over TP
       once more because its name contains ``q_layernorm`` and ``config.qk_layernorm`` is
       set (a rule meant for per-head q/k norms, whose gradients *are* partial).
       (``kv_layernorm`` does not match that rule, so it is right.)

    The fixes move or add one TP reduction; nothing changes at TP = 1, and with sequence
    parallelism only (1) applies:

    1. The down projection's output is gathered here, and the rope part gets a
       ``copy_to_tensor_model_parallel_region`` (backward: all-reduce of its gradient)
       before the heads use it. With sequence parallelism the gathered output is scattered
       over the sequence instead, which sends Megatron down its "duplicated linear" branch:
       there ``gather_from_sequence_parallel_region(k_pos_emb)`` reduce-scatters the
       gradient, summing the heads of all ranks.
    2. Without sequence parallelism the all-reduce of the query latent's gradient is moved
       from ``linear_q_up_proj``'s input (after the norm) to the norm's input, so the
       norm's weight gradient is the per-rank partial sum that ``finalize_model_grads``
       expects to sum. Same communication as before.
    """

    def __init__(self, config, submodules, *args, **kwargs) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        self._tp_size = self.tp_group.size() if self.tp_group is not None else 1
        self._sharded_kv_down = self._tp_size > 1 and isinstance(self.linear_kv_down_proj, ColumnParallelLinear)
        self._q_grad_reduce_before_norm = (
            self._tp_size > 1
            and not config.sequence_parallel
            and config.q_lora_rank is not None
            and config.qk_layernorm
            and isinstance(self.linear_q_up_proj, ColumnParallelLinear)
        )
        if self._q_grad_reduce_before_norm:
            # Done in _qkv_down_projection, before q_layernorm, instead.
            self.linear_q_up_proj.disable_grad_reduce = True
            self.linear_q_up_proj.allreduce_dgrad = False

    def _qkv_down_projection(self, hidden_states):
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        if self._q_grad_reduce_before_norm:
            q_compressed = copy_to_tensor_model_parallel_region(q_compressed, group=self.tp_group)
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if not self._sharded_kv_down or kv_combined.size(-1) == width:
            return q_compressed, kv_combined
        # [s, b, width / TP] -> [s, b, width] (backward: split)
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            # [s / TP, b, width]: Megatron splits it and gathers k_pos_emb over the sequence,
            # whose backward (reduce-scatter) sums the rope gradient over TP ranks.
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1
        )
        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        return q_compressed, torch.cat([kv_compressed, k_pos_emb], dim=-1)
