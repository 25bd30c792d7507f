"""Parameter counts of a GPT from its arguments, without building it.

Used by the benchmarks and to check recipes of real-size models against their published
totals. Counts weights only (no biases: the recipes use ``--disable-bias-linear``);
``active`` counts the experts a token is routed to (top-k routed plus the shared ones).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int

    def __str__(self) -> str:
        if self.total == self.active:
            return f"{_human(self.total)} parameters"
        return f"{_human(self.total)} parameters, {_human(self.active)} active per token"


def _human(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def moe_layer_pattern(args: argparse.Namespace) -> List[int]:
    """1 for an MoE layer, 0 for a dense one (Megatron's ``--moe-layer-freq``)."""
    if not args.num_experts:
        return [0] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        return list(freq)
    return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]


def attention_parameters(args: argparse.Namespace) -> int:
    h, nh = args.hidden_size, args.num_attention_heads
    if args.multi_latent_attention:
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank:
            q = h * args.q_lora_rank + args.q_lora_rank * nh * qk + (args.q_lora_rank if args.qk_layernorm else 0)
        else:
            q = h * nh * qk
        kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
        kv += args.kv_lora_rank * nh * (args.qk_head_dim + args.v_head_dim)
        kv += args.kv_lora_rank if args.qk_layernorm else 0
        return q + kv + nh * args.v_head_dim * h
    d, ng = args.kv_channels, args.num_query_groups
    qk_norms = 2 * d if args.qk_layernorm else 0
    return h * (nh + 2 * ng) * d + nh * d * h + qk_norms


def mlp_parameters(hidden: int, ffn: int, swiglu: bool) -> int:
    return (3 if swiglu else 2) * hidden * ffn


def count_parameters(args: argparse.Namespace, vocab_size: int) -> ParameterCount:
    """Total and per-token active parameters of the model ``args`` describe."""
    h = args.hidden_size
    embed = vocab_size * h * (2 if args.untie_embeddings_and_output_weights else 1)
    if args.position_embedding_type == "learned_absolute":
        embed += args.max_position_embeddings * h
    total = active = embed + h  # + final norm
    for is_moe in moe_layer_pattern(args):
        layer = attention_parameters(args) + 2 * h  # + input and pre-MLP norms
        layer_active = layer
        if is_moe:
            expert = mlp_parameters(h, args.moe_ffn_hidden_size, args.swiglu)
            shared = mlp_parameters(h, args.moe_shared_expert_intermediate_size or 0, args.swiglu)
            router = args.num_experts * h
            layer += router + shared + args.num_experts * expert
            layer_active += router + shared + args.moe_router_topk * expert
        else:
            dense = mlp_parameters(h, args.ffn_hidden_size, args.swiglu)
            layer += dense
            layer_active += dense
        total += layer
        active += layer_active
    return ParameterCount(total, active)
