"""The oracle: a deliberately simple, single-process Muon (+ AdamW for the rest).

Every distributed test compares against this module, so it is written to be obviously
correct rather than fast. It works on the full, unsharded parameters of a one-rank model
(fp32), orthogonalizes one logical matrix at a time, and deliberately does NOT shard,
communicate, batch, pipeline, cast to a communication dtype, or import anything from the
distributed implementation (``matrices``, ``planner``, ``pipeline``, ``optimizer``): its
splitting rules below are written independently from the model's ``TransformerConfig``.

One ``ReferenceMuon.step()``, all fp32 on full tensors:

1. Gradient of each parameter: ``.main_grad`` if present, else ``.grad``, else zeros
   (Megatron DDP gives every parameter a zero grad buffer, so unused experts still get
   momentum / weight decay / AdamW updates). Clipping as Megatron: ``norm`` = L2 norm over
   all grads; if ``clip_grad > 0`` and ``coeff = clip_grad / (norm + 1e-6) < 1``, all
   grads are multiplied by ``coeff``. ``step()`` returns ``norm`` (before clipping).
2. Muon parameters (``is_muon_matrix``): 2-D weights except word/position embeddings,
   ``output_layer.weight``, the MoE router (unless ``muon_router_optimizer == "muon"``)
   and names matching ``muon_exclude_patterns`` (fnmatch); ``muon_param_filter``, when
   set, decides alone. Everything else goes to AdamW.
3. Logical matrices (``logical_matrices``) of a Muon parameter: a fused ``linear_qkv``
   (rows per query group: ``[q heads, k, v]``) splits, if ``muon_split_qkv``, into
   Q, K, V ("part"), Q_g, K_g, V_g per group ("group") or one matrix per q/k/v head
   ("head"); a gated ``linear_fc1`` (also of experts / shared experts / ``weight<i>``)
   splits into ``[gate; up]`` row halves if ``muon_split_glu``; legacy fused expert
   weights ``weight1`` / ``weight2`` (module with ``num_local_experts``) give one matrix
   per expert, ``weight1.view(E, h, -1)[e].T`` (``(ffn, h)``, halved by column if GLU
   split) and ``weight2.view(E, -1, h)[e].T`` (``(h, ffn)``); anything else is one matrix.
4. Muon per parameter: ``buf = mu * buf + g``; ``u = g + mu * buf`` (Nesterov) or
   ``buf``; each logical matrix ``M`` (logical ``(out, in)`` orientation) of ``u`` is
   replaced by ``orthogonalize(M) * update_scale(config, out, in)``; then
   ``p *= 1 - lr * wd``; ``p -= lr * update``.
   With ``muon_variance_reduction = beta2`` (nanochat / NorMuon), ``newton_schulz(M)`` =
   ``O`` is first reweighted: per row of ``O`` if ``out >= in`` (else per column), the
   mean square ``v`` feeds ``s = beta2 * s + (1 - beta2) * v`` (``s`` starts at 0, one per
   logical matrix), ``O`` is multiplied by ``1 / sqrt(max(s, 1e-10))`` along that axis
   and then rescaled to its former Frobenius norm. With ``muon_cautious_weight_decay``
   the decay ``lr * wd * p`` only touches entries where ``update * p >= 0`` (``p``
   before the step).
   With ``muon_hyperball`` (Muon-Hyperball, Wen et al. 2026) the logical matrix ``W`` of
   ``p`` instead becomes ``R * n(W - lr * R * n(O))`` with ``n(X) = X / ||X||_F`` (``O`` the
   orthogonalized, variance-reduced matrix; no scale, no weight decay) and ``R`` the
   matrix's Frobenius norm before its first such step (or ``muon_hyperball_radius *
   sqrt(out * in)``), kept per logical matrix.
5. AdamW for the rest, exactly ``torch.optim.AdamW``'s (single-tensor) arithmetic.
6. ``lr`` = ``config.lr`` (or ``self.lr``, or ``step(lr=...)``); ``wd`` =
   ``config.weight_decay * wd_mult``, ``wd_mult`` = 0 for 1-D params and ``*.bias``,
   else 1 (Megatron's standard overrides).
7. MuonClip (``muon_clip_``) when the model's ``TransformerConfig.qk_clip`` is set: per
   head, from the max logits its core attention recorded during the step's forwards.
   MLA up-projections split per head into [q nope; q rope] / [k nope; v] rows
   (``muon_mla_granularity`` 'part' joins each part over the heads, 'head' keeps them apart).
"""

from __future__ import annotations

import math
import re
from fnmatch import fnmatch
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron_muon.config import MuonConfig, update_scale
from megatron_muon.newton_schulz import COEFFICIENT_SETS


class LogicalMatrix(NamedTuple):
    """``t.view(view_shape)[index]`` is a 2-D piece of a parameter-shaped tensor ``t``; the
    logical ``(out, in)`` matrix is that piece, or its transpose if ``transposed``."""

    view_shape: Tuple[int, ...]
    index: tuple
    transposed: bool = False

    def read(self, t: torch.Tensor) -> torch.Tensor:
        piece = t.view(self.view_shape)[self.index]
        return piece.T if self.transposed else piece

    def write(self, t: torch.Tensor, m: torch.Tensor) -> None:
        t.view(self.view_shape)[self.index] = m.T if self.transposed else m


def _rows(shape: Sequence[int], rows: Sequence[int]) -> LogicalMatrix:
    return LogicalMatrix(tuple(shape), (torch.tensor(list(rows), dtype=torch.long),))


def is_muon_matrix(name: str, param: torch.Tensor, config: MuonConfig) -> bool:
    """Whether ``param`` (named as in the unwrapped model) is optimized by Muon."""
    if config.muon_param_filter is not None:
        return bool(config.muon_param_filter(name, param))
    if param.dim() != 2:
        return False
    if re.search(r"(word|position)_embeddings\.weight$", name) or name.endswith("output_layer.weight"):
        return False
    if name.endswith("router.weight") and config.muon_router_optimizer != "muon":
        return False
    return not any(fnmatch(name, pattern) for pattern in config.muon_exclude_patterns)


def qkv_row_sets(nh: int, ng: int, d: int, granularity: str) -> List[List[int]]:
    """Row indices of each logical matrix of a fused ``linear_qkv`` weight."""
    qpg, per_group = nh // ng, (nh // ng + 2) * d
    q = [list(range(g * per_group, g * per_group + qpg * d)) for g in range(ng)]
    k = [list(range(g * per_group + qpg * d, g * per_group + (qpg + 1) * d)) for g in range(ng)]
    v = [list(range(g * per_group + (qpg + 1) * d, (g + 1) * per_group)) for g in range(ng)]
    if granularity == "part":
        return [sum(q, []), sum(k, []), sum(v, [])]
    if granularity == "group":
        return [rows for g in range(ng) for rows in (q[g], k[g], v[g])]
    heads = [q[g][i * d : (i + 1) * d] for g in range(ng) for i in range(qpg)]
    return heads + k + v


def mla_row_sets(heads: int, first: int, second: int, granularity: str) -> List[List[int]]:
    """Row indices of the matrices of an MLA up-projection whose rows are, per head,
    ``[first part; second part]`` (q: nope, rope; kv: k nope, v)."""
    per = first + second
    a = [list(range(h * per, h * per + first)) for h in range(heads)]
    b = [list(range(h * per + first, (h + 1) * per)) for h in range(heads)]
    if granularity == "part":
        return [sum(a, []), sum(b, [])]
    return a + b


def logical_matrices(
    name: str, shape: Sequence[int], tconfig: Any, config: MuonConfig, module: Any = None
) -> List[LogicalMatrix]:
    """The logical matrices of a Muon parameter of ``shape`` (see the module docstring).

    ``tconfig`` is the model's ``TransformerConfig`` (or any object with its attribute
    names; None means no splitting); ``module`` is the module owning the parameter.
    """
    shape = tuple(shape)
    leaf = name.rsplit(".", 1)[-1]
    glu = bool(getattr(tconfig, "gated_linear_unit", False))
    if leaf in ("weight1", "weight2") and hasattr(module, "num_local_experts"):
        E = module.num_local_experts
        if leaf == "weight2":  # [E*ffn, h] read as view(E, ffn, h)[e] = (in, out)
            view = (E, shape[0] // E, shape[1])
            return [LogicalMatrix(view, (e,), True) for e in range(E)]
        view = (E, shape[0], shape[1] // E)  # [h, E*ffn] read as view(E, h, ffn)[e] = (in, out)
        n, halves = view[2], 2 if glu and config.muon_split_glu else 1
        cols = [(i * n // halves, (i + 1) * n // halves) for i in range(halves)]
        return [LogicalMatrix(view, (e, slice(None), slice(a, b)), True) for e in range(E) for a, b in cols]
    if name.endswith("linear_qkv.weight") and config.muon_split_qkv and tconfig is not None:
        nh = tconfig.num_attention_heads
        ng = tconfig.num_query_groups or nh
        d = tconfig.kv_channels or tconfig.hidden_size // nh
        assert shape[0] == ng * (nh // ng + 2) * d, (name, shape, nh, ng, d)
        return [_rows(shape, rows) for rows in qkv_row_sets(nh, ng, d, config.muon_qkv_granularity)]
    mla = re.search(r"(linear_q_proj|linear_q_up_proj|linear_kv_up_proj)\.weight$", name)
    if mla and getattr(tconfig, "multi_latent_attention", False) and config.muon_split_mla:
        second = tconfig.qk_pos_emb_head_dim if "_q_" in name else tconfig.v_head_dim
        return [
            _rows(shape, rows)
            for rows in mla_row_sets(
                tconfig.num_attention_heads, tconfig.qk_head_dim, second, config.muon_mla_granularity
            )
        ]
    if re.search(r"linear_fc1\.weight\d*$", name) and glu and config.muon_split_glu:
        half = shape[0] // 2
        return [_rows(shape, range(half)), _rows(shape, range(half, shape[0]))]
    return [LogicalMatrix(shape, (slice(None),))]


def normuon(o: torch.Tensor, moment: Optional[torch.Tensor], beta2: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Variance reduction of one orthogonalized ``(out, in)`` matrix: returns the
    reweighted matrix and the new second moment (a vector over rows or columns)."""
    by_row = o.shape[0] >= o.shape[1]
    v = (o * o).mean(dim=1 if by_row else 0)
    moment = (1 - beta2) * v if moment is None else beta2 * moment + (1 - beta2) * v
    weight = 1.0 / moment.clamp(min=1e-10).sqrt()
    scaled = o * (weight[:, None] if by_row else weight[None, :])
    return scaled * (o.norm() / scaled.norm().clamp(min=1e-10)), moment


def orthogonalize(m: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """Newton–Schulz of one 2-D matrix, written independently of
    ``megatron_muon.newton_schulz`` (only the coefficient table is shared) so that the
    exactness tests compare two implementations: whatever ``muon_ns_method`` the optimizer
    uses (standard, Gram, split over ranks), this iterates ``X <- a X + b (X X^T) X +
    c (X X^T)^2 X`` on the Frobenius-normalised wide orientation, one plain product at a
    time, in ``muon_ns_dtype``."""
    wide = m.T if m.shape[0] > m.shape[1] else m
    x = wide.float() / (wide.float().norm() + 1e-7)
    x = x.to(config.muon_ns_dtype)
    coefficients = COEFFICIENT_SETS[config.muon_coefficient_type]
    for step in range(config.muon_num_ns_steps):
        a, b, c = coefficients.for_step(step)
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x.to(m.dtype)
    return x.T if m.shape[0] > m.shape[1] else x


def orthogonalized_update(
    u: torch.Tensor, matrices: List[LogicalMatrix], config: MuonConfig, moments: Optional[list] = None
) -> torch.Tensor:
    """Newton–Schulz of each logical matrix of ``u`` (variance-reduced if configured, with
    ``moments[i]`` the i-th matrix's second moment), times its update scale."""
    out = torch.empty_like(u)
    for i, lm in enumerate(matrices):
        m = lm.read(u)
        o = orthogonalize(m, config)
        if config.muon_variance_reduction is not None:
            o, moments[i] = normuon(o.float(), moments[i], config.muon_variance_reduction)
        lm.write(out, o * update_scale(config, m.shape[0], m.shape[1]))
    return out


def assert_partition(name: str, shape: Sequence[int], matrices: List[LogicalMatrix]) -> None:
    """Every element of the parameter belongs to exactly one logical matrix."""
    count = torch.zeros(tuple(shape))
    for lm in matrices:
        lm.write(count, lm.read(count) + 1)
    assert bool((count == 1).all()), f"the logical matrices of {name} do not partition it"


def muon_update(
    p, g, state, lr: float, wd: float, matrices, config: MuonConfig, mask: Optional[torch.Tensor] = None
) -> None:
    """Momentum (per parameter), orthogonalization (per logical matrix), decoupled wd.

    Cautious weight decay applies ``mask`` where given (the mask another implementation
    computed: the rule ``update * p >= 0`` is discontinuous, so rounding flips elements near
    zero) and records in ``state["cautious"]`` how many elements its own mask would set
    differently, and the largest ``|update * p|`` among them relative to the largest overall."""
    buf = state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.float32))
    mu = config.muon_momentum
    buf.mul_(mu).add_(g)
    u = g + mu * buf if config.muon_nesterov else buf
    moments = state.setdefault("second_moment", [None] * len(matrices))
    update = orthogonalized_update(u, matrices, config, moments)
    if config.muon_cautious_weight_decay:
        product = update * p
        own = product >= 0
        mask = own if mask is None else mask.to(torch.bool)
        flipped = own != mask
        peak = float(product.abs().max().clamp_min(1e-30))
        state["cautious"] = (
            int(flipped.sum()),
            own.numel(),
            float(product[flipped].abs().max()) / peak if flipped.any() else 0.0,
        )
        decay = lr * wd * p * mask
        p.sub_(decay + lr * update)
    else:
        p.mul_(1 - lr * wd).add_(update, alpha=-lr)


def hyperball_update(p, g, state, lr: float, matrices, config: MuonConfig) -> None:
    """Muon-Hyperball on one parameter: momentum as Muon's, then each logical matrix put
    back on the sphere of its radius after a step of length ``lr * R`` along the normalized
    orthogonalized update. Written on whole fp32 matrices, one at a time."""
    buf = state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.float32))
    mu = config.muon_momentum
    buf.mul_(mu).add_(g)
    u = g + mu * buf if config.muon_nesterov else buf
    moments = state.setdefault("second_moment", [None] * len(matrices))
    radii = state.setdefault("hyperball_radius", [None] * len(matrices))
    for i, lm in enumerate(matrices):
        o = orthogonalize(lm.read(u), config).float()
        if config.muon_variance_reduction is not None:
            o, moments[i] = normuon(o, moments[i], config.muon_variance_reduction)
        w = lm.read(p).clone()
        if radii[i] is None:
            given = config.muon_hyperball_radius
            radii[i] = given * math.sqrt(w.numel()) if given is not None else float(w.norm())
        radius = radii[i]
        stepped = w - lr * radius * (o / o.norm().clamp(min=1e-12))
        lm.write(p, radius * stepped / stepped.norm().clamp(min=1e-12))


def adamw_update(p, g, state, lr: float, wd: float, config: MuonConfig) -> None:
    """``torch.optim.AdamW`` (single-tensor, no amsgrad) on one parameter."""
    b1, b2 = config.adam_beta1, config.adam_beta2
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    state["step"] += 1
    step = state["step"]
    state["exp_avg"].lerp_(g, 1 - b1)
    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
    p.mul_(1 - lr * wd)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**step)).add_(config.adam_eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**step))


def muon_clip_(modules: Sequence[torch.nn.Module], tconfig: Any) -> None:
    """MuonClip (Kimi K2, Algorithm 1) on full weights, one head at a time, then reset the
    recorders. ``gamma_h = tau / S_h`` where ``S_h > tau``, else 1. MHA/GQA: K rows of group g scaled by
    ``min_{h in g} gamma_h ** (1 - alpha)``, Q rows of head h by ``gamma_h`` divided by that,
    so every head's logits scale by exactly ``gamma_h``. MLA: q nope and k nope rows of
    head h by ``sqrt(gamma_h)``, q rope rows by ``gamma_h``; v and the shared k rope untouched."""
    if not modules:
        return
    tau, alpha = tconfig.qk_clip_threshold, tconfig.qk_clip_alpha
    for attn in modules:
        core = attn.core_attention
        s_max = core.current_max_attn_logits
        core.current_max_attn_logits = None
        if not tconfig.qk_clip or s_max is None:
            continue
        gamma = [tau / float(s) if float(s) > tau else 1.0 for s in s_max]  # clipped only above tau
        heads = len(gamma)
        if hasattr(attn, "linear_qkv"):
            w = attn.linear_qkv.weight.data
            groups = tconfig.num_query_groups or heads
            qpg, d = heads // groups, tconfig.kv_channels
            per_group = (qpg + 2) * d
            for g in range(groups):
                k_scale = min(gamma[g * qpg : (g + 1) * qpg]) ** (1 - alpha)
                k0 = g * per_group + qpg * d
                w[k0 : k0 + d] *= k_scale
                for i in range(qpg):
                    q0 = g * per_group + i * d
                    w[q0 : q0 + d] *= gamma[g * qpg + i] / k_scale
        else:
            q_proj = getattr(attn, "linear_q_up_proj", None) or attn.linear_q_proj
            wq, wkv = q_proj.weight.data, attn.linear_kv_up_proj.weight.data
            nope, rope, v = tconfig.qk_head_dim, tconfig.qk_pos_emb_head_dim, tconfig.v_head_dim
            for h in range(heads):
                root = math.sqrt(gamma[h])
                wq[h * (nope + rope) : h * (nope + rope) + nope] *= root
                wq[h * (nope + rope) + nope : (h + 1) * (nope + rope)] *= gamma[h]
                wkv[h * (nope + v) : h * (nope + v) + nope] *= root


def wd_mult(name: str, param: torch.Tensor) -> float:
    """Megatron's standard override: no weight decay on 1-D params and biases."""
    return 0.0 if param.dim() == 1 or name.endswith(".bias") else 1.0


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return module


class ReferenceMuon:
    """Single-process Muon + AdamW over full parameters (see the module docstring)."""

    def __init__(self, model, config: MuonConfig):
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.config, self.lr = config, config.lr
        self.params: Dict[str, torch.nn.Parameter] = {}
        self.matrices: Dict[str, Optional[List[LogicalMatrix]]] = {}  # None: AdamW
        self.state: Dict[str, Dict[str, Any]] = {}
        self.attention = [
            m
            for c in chunks
            for m in _unwrap(c).modules()
            if hasattr(getattr(m, "core_attention", None), "current_max_attn_logits")
        ]
        self.tconfig = getattr(_unwrap(chunks[0]), "config", None)
        seen = set()
        for i, chunk in enumerate(chunks):
            chunk = _unwrap(chunk)
            prefix = f"chunk{i}." if len(chunks) > 1 else ""
            for mod_name, module in chunk.named_modules():
                tconfig = getattr(module, "config", None) or getattr(chunk, "config", None)
                for leaf, p in module.named_parameters(recurse=False):
                    name = f"{mod_name}.{leaf}" if mod_name else leaf
                    if id(p) in seen:
                        continue  # shared (tied) parameter: once
                    seen.add(id(p))
                    if p.dtype != torch.float32:
                        raise ValueError(f"ReferenceMuon needs fp32 parameters; {name} is {p.dtype}")
                    key = prefix + name
                    self.params[key], self.state[key] = p, {}
                    self.matrices[key] = None
                    if is_muon_matrix(name, p, config):
                        self.matrices[key] = logical_matrices(name, p.shape, tconfig, config, module)
                        assert_partition(key, p.shape, self.matrices[key])

    @staticmethod
    def _grad(p: torch.nn.Parameter) -> torch.Tensor:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        return torch.zeros_like(p) if g is None else g.detach().float().clone()

    @torch.no_grad()
    def step(self, lr: Optional[float] = None, cautious_masks: Optional[Dict[str, torch.Tensor]] = None) -> float:
        """One optimizer step from the current grads; returns the grad norm before clipping.
        ``cautious_masks``: param key -> the cautious weight decay mask to apply (see
        :func:`muon_update`)."""
        lr = self.lr if lr is None else lr
        grads = {k: self._grad(p) for k, p in self.params.items()}
        norm = float(torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt())
        if self.config.clip_grad > 0:
            coeff = self.config.clip_grad / (norm + 1e-6)
            if coeff < 1:
                for g in grads.values():
                    g.mul_(coeff)
        for key, p in self.params.items():
            wd = self.config.weight_decay * wd_mult(key, p)
            if self.matrices[key] is None:
                adamw_update(p.data, grads[key], self.state[key], lr, wd, self.config)
            elif self.config.muon_hyperball:
                hyperball_update(p.data, grads[key], self.state[key], lr, self.matrices[key], self.config)
            else:
                mask = (cautious_masks or {}).get(key)
                muon_update(p.data, grads[key], self.state[key], lr, wd, self.matrices[key], self.config, mask)
        muon_clip_(self.attention, self.tconfig)
        return norm
