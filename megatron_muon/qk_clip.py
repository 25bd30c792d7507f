"""QK-Clip (MuonClip): keep attention logits bounded by rescaling q/k weights per head.

After each optimizer update, for every attention head h with max pre-softmax logit
``S_h`` in the step (recorded by the core attention, all-reduced with MAX over the
data- and context-parallel ranks, which saw different tokens), ``gamma_h =
min(1, tau / S_h)`` and the weights producing q and k are scaled so that head h's
logits scale by exactly ``gamma_h``:

* MHA / GQA (fused ``linear_qkv``): the K head of group g, shared by its query heads,
  by ``m_g ** (1 - alpha)`` with ``m_g = min_{h in g} gamma_h``; each Q head by
  ``gamma_h / m_g ** (1 - alpha)``. For MHA that is ``gamma ** alpha`` and
  ``gamma ** (1 - alpha)``; for GQA no sibling head is clipped more than it needs.
* MLA (Kimi K2, Algorithm 1): q nope rows and k nope rows (``linear_kv_up_proj``) of
  head h by ``sqrt(gamma_h)``, q rope rows by ``gamma_h``; v rows and the shared k rope
  (in ``linear_kv_down_proj``) untouched.

The scaling is applied to the distributed optimizer's fp32 master shards: each rank
scales the rows its shard covers (a shard is a byte range, so it may start and end
mid-row), and the usual master -> model copy and parameter all-gather follow. Heads are
local to their TP rank and layers to their pipeline stage, so no other communication is
needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .matrices import storage_shape


@dataclass
class ClipLayer:
    """One attention layer: its recorder and the weights whose rows QK-Clip scales."""

    name: str
    attention: torch.nn.Module
    kind: str  # "gqa" or "mla"
    weights: List[Tuple[str, torch.nn.Parameter]]
    heads: int
    groups: int

    @property
    def recorder(self) -> torch.nn.Module:
        return self.attention.core_attention


def _ones(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(n, dtype=like.dtype, device=like.device)


def head_gammas(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each head's clip factor ``min(1, tau / S_max)``, 1 where ``S_max <= tau``: a head whose
    largest logit is negative (every score below zero) is not clipped (``tau / S_max`` would
    be negative there, and its square root NaN)."""
    return threshold / max_logits.clamp(min=threshold)


def row_factors(layer: ClipLayer, gamma: torch.Tensor, tconfig) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """Per-row scale factors of each weight of ``layer`` for per-head ``gamma``; the rows of
    each part come from the logical-matrix definitions (``matrices.qkv_parts`` /
    ``mla_parts``)."""
    from .matrices import mla_parts, qkv_parts

    if layer.kind == "gqa":
        hpg = layer.heads // layer.groups
        k_scale = gamma.view(layer.groups, hpg).amin(dim=1) ** (1 - tconfig.qk_clip_alpha)
        q_scale = gamma / k_scale.repeat_interleave(hpg)
        rows = []
        for g in range(layer.groups):
            for role, count in qkv_parts(tconfig):
                if role == "q":
                    rows.append(q_scale[g * hpg : (g + 1) * hpg].repeat_interleave(count // hpg))
                else:
                    rows.append(k_scale[g].expand(count) if role == "k" else _ones(count, gamma))
        return [(layer.weights[0][1], torch.cat(rows))]
    root = gamma.sqrt()
    by_role = {"q_nope": root, "q_rope": gamma, "k_nope": root}
    out = []
    for (_, weight), projection in zip(layer.weights, ("q", "kv")):
        rows = [
            by_role[role][h].expand(count) if role in by_role else _ones(count, gamma)
            for h in range(layer.heads)
            for role, count in mla_parts(tconfig, projection)
        ]
        out.append((weight, torch.cat(rows)))
    return out


def scale_rows_(shard: torch.Tensor, start: int, end: int, cols: int, factors: torch.Tensor) -> None:
    """Multiply the elements ``start:end`` of a row-major ``[rows, cols]`` weight, held as
    the 1-D ``shard``, by their row's factor (the range may start/end mid-row)."""
    factors = factors.to(shard.device, shard.dtype)  # a CPU-offloaded master: factors come over
    pos = start
    while pos < end:
        row = pos // cols
        row_end = min((row + 1) * cols, end)
        if pos % cols == 0 and row_end - pos == cols:
            # A run of whole rows: one broadcast multiply.
            last = end // cols
            n = last - row
            shard[pos - start : pos - start + n * cols].view(n, cols).mul_(factors[row:last, None])
            pos += n * cols
        else:
            shard[pos - start : row_end - start].mul_(factors[row])
            pos = row_end


def scale_master_rows_(
    shard_map, param: torch.nn.Parameter, factors: torch.Tensor, piece: Optional[Tuple[torch.Tensor, int, int]] = None
) -> None:
    """Scale the rows of ``param`` that this rank's fp32 master shard covers by ``factors``;
    with ``piece`` ``(values, start, end)``, only the master's elements ``start:end``, held
    in ``values`` (a copy staged on the device)."""
    shard = shard_map[param]
    if piece is not None:
        values, start, end = piece
        scale_rows_(values, shard.start + start, shard.start + end, storage_shape(param)[1], factors)
    elif shard.master is not None:
        scale_rows_(shard.master, shard.start, shard.end, storage_shape(param)[1], factors)


def clip_requirements(qk_layernorm: bool, query_groups: int, tp_size: int, where: str = "") -> List[str]:
    """What QK-Clip needs of an attention to bound its logits by scaling W_q / W_k, as one
    sentence each naming the setting, its Megatron-LM flag and the fix (``where`` names the
    layer once a model is built): read by :meth:`QKClip.from_model` on the built modules and
    by Megatron-LM's argument check on the flags, before any model is built. MLA is exempt:
    its norms act on the latents, which clipping leaves exact."""
    at = f" ({where})" if where else ""
    refusals = []
    if qk_layernorm:
        refusals.append(
            f"QK-Clip cannot bound the logits{at} with qk_layernorm (--qk-layernorm): the q / k norms after the "
            "projections undo any scaling of W_q / W_k (the logits are bounded by the norms' weights); disable "
            "qk_layernorm or qk_clip (--qk-clip)"
        )
    if query_groups < tp_size:
        refusals.append(
            f"QK-Clip cannot clip{at} {query_groups} query groups (num_query_groups, --num-query-groups) at "
            f"tensor_model_parallel_size {tp_size} (--tensor-model-parallel-size): a query group's rows would be "
            "split over TP ranks; use at least as many query groups as TP ranks, or disable qk_clip (--qk-clip)"
        )
    return refusals


class QKClip:
    """QK-Clip for the attention layers of this rank's model chunks."""

    def __init__(self, layers: Sequence[ClipLayer], tconfig, dp_cp_group, mp_group) -> None:
        self.layers = list(layers)
        self.tconfig = tconfig
        self.dp_cp_group = dp_cp_group
        self.mp_group = mp_group
        self.clip = bool(tconfig.qk_clip)
        self.last_max_logits: Optional[torch.Tensor] = None
        """Per head (this rank's layers, concatenated) max logits of the last step."""
        self.max_attention_logit: float = 0.0
        """Largest logit of the last step over the whole model (for logging)."""
        self.heads_clipped = 0
        """Heads of this rank's layers whose weights the last step's clip scaled."""

    @classmethod
    def from_model(cls, model_chunks: Sequence[torch.nn.Module], dp_cp_group, mp_group) -> Optional["QKClip"]:
        """QK-Clip if the model config asks for it (``qk_clip`` or ``log_max_attention_logit``)."""
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

        from .matrices import unwrap

        tconfig = getattr(unwrap(model_chunks[0]), "config", None)
        if tconfig is None or not (
            getattr(tconfig, "qk_clip", False) or getattr(tconfig, "log_max_attention_logit", False)
        ):
            return None
        if tconfig.qk_clip and not 0.0 < tconfig.qk_clip_alpha < 1.0:
            raise ValueError(f"qk_clip_alpha must be in (0, 1), got {tconfig.qk_clip_alpha}.")
        if tconfig.qk_clip and not (math.isfinite(tconfig.qk_clip_threshold) and tconfig.qk_clip_threshold > 0):
            raise ValueError(
                f"qk_clip_threshold must be a finite number > 0 (TransformerConfig.qk_clip_threshold; the default is "
                f"100), got {tconfig.qk_clip_threshold}."
            )
        layers = []
        for i, chunk in enumerate(model_chunks):
            for name, module in unwrap(chunk).named_modules():
                if not isinstance(module, (SelfAttention, MultiLatentAttention)):
                    continue
                full = f"chunk{i}.{name}"
                core = module.core_attention
                if not hasattr(core, "current_max_attn_logits"):
                    raise ValueError(
                        f"QK-Clip: {full} uses {type(core).__name__}, which records no per-head max "
                        "logits. Build the model with megatron_muon.layer_specs.gpt_layer_spec (plain "
                        "torch) or transformer-engine's attention."
                    )
                heads = module.num_attention_heads_per_partition
                if isinstance(module, SelfAttention):
                    norms = (getattr(module, "q_layernorm", None), getattr(module, "k_layernorm", None))
                    normed = any(n is not None and not isinstance(n, IdentityOp) for n in norms)
                    refusals = clip_requirements(normed, tconfig.num_query_groups, module.world_size, full)
                    if tconfig.qk_clip and refusals:
                        raise ValueError(refusals[0])
                    weights = [("qkv", module.linear_qkv.weight)]
                    groups = module.num_query_groups_per_partition
                    layers.append(ClipLayer(full, module, "gqa", weights, heads, groups))
                else:
                    q = getattr(module, "linear_q_up_proj", None) or module.linear_q_proj
                    weights = [("q", q.weight), ("kv_up", module.linear_kv_up_proj.weight)]
                    layers.append(ClipLayer(full, module, "mla", weights, heads, heads))
        return cls(layers, tconfig, dp_cp_group, mp_group)

    def gather_max_logits(self) -> Optional[torch.Tensor]:
        """This step's per-head maxima of this rank's layers, MAX-reduced over DP x CP."""
        if not self.layers:
            return None
        maxima = []
        for layer in self.layers:
            m = layer.recorder.current_max_attn_logits
            if m is None:
                raise RuntimeError(
                    f"QK-Clip: {layer.name} recorded no max logits this step. Run the forward in "
                    "training mode with TransformerConfig.qk_clip (or log_max_attention_logit) set."
                )
            maxima.append(m.detach().float().reshape(-1))
        maxima = torch.cat(maxima)
        if self.dp_cp_group is not None and self.dp_cp_group.size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dp_cp_group)
        return maxima

    @torch.no_grad()
    def measure(self) -> Optional[torch.Tensor]:
        """This step's per-head maxima (:meth:`gather_max_logits`, kept in
        ``last_max_logits``) and the largest over the whole model (``max_attention_logit``,
        MAX over the model-parallel group)."""
        maxima = self.gather_max_logits()
        self.last_max_logits = maxima
        local = float(maxima.max()) if maxima is not None else -math.inf
        device = maxima.device if maxima is not None else self._device()
        peak = torch.tensor([local], device=device)  # NCCL needs it on the GPU
        if self.mp_group is not None and self.mp_group.size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.mp_group)
        self.max_attention_logit = float(peak[0])
        return maxima

    @torch.no_grad()
    def apply(self, shard_map) -> None:
        """:meth:`measure`, then clip (if ``qk_clip``) on the fp32 masters of ``shard_map``
        (a :class:`~megatron_muon.shard_map.ShardMap`). The chained optimizer resets the
        recorders after every step, taken or skipped."""
        for param, factors in self.clip_factors():
            scale_master_rows_(shard_map, param, factors)

    @torch.no_grad()
    def clip_factors(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        """:meth:`measure` (collective), then the factor of every row of every weight this
        step's clip scales (none without ``qk_clip``); counts ``heads_clipped``."""
        maxima = self.measure()
        self.heads_clipped = 0
        out: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
        if not self.clip or maxima is None:
            return out
        offset = 0
        for layer in self.layers:
            s = maxima[offset : offset + layer.heads]
            offset += layer.heads
            gamma = head_gammas(s, self.tconfig.qk_clip_threshold)
            clipped = int((gamma < 1.0).sum())
            if clipped:
                self.heads_clipped += clipped
                out.extend(row_factors(layer, gamma, self.tconfig))
        return out

    def layer_maxima(self) -> Dict[Tuple[str, int], float]:
        """The last step's largest logit of each of this rank's layers (its heads on this TP
        rank), keyed by the layer's global number in its block: ``("decoder", n)`` or, for a
        multi-token-prediction layer (numbered from 1 again), ``("mtp", n)``."""
        out: Dict[Tuple[str, int], float] = {}
        if self.last_max_logits is None:
            return out
        offset = 0
        for layer in self.layers:
            block = "mtp" if ".mtp." in f".{layer.name}." else "decoder"
            number = int(getattr(layer.attention, "layer_number", len(out) + 1))
            out[(block, number)] = float(self.last_max_logits[offset : offset + layer.heads].max())
            offset += layer.heads
        return out

    def _device(self) -> torch.device:
        for layer in self.layers:
            return layer.weights[0][1].device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def reset(self) -> None:
        """Clear every layer's recorded max logits (a new step records afresh)."""
        for layer in self.layers:
            layer.recorder.current_max_attn_logits = None
