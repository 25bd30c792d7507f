"""``MuonConfig``: Megatron's ``OptimizerConfig`` plus the settings of exact distributed Muon.

Field names follow Megatron-core where it has one (``muon_momentum``, ``muon_tp_mode``, ...);
the defaults are ours where we differ on purpose (exact TP mode, Moonlight update scale,
Nesterov on). QK-Clip settings are read from the model's ``TransformerConfig``
(``qk_clip``, ``qk_clip_threshold``, ``qk_clip_alpha``), as in Megatron.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.optimizer import OptimizerConfig

from .newton_schulz import COEFFICIENT_SETS, NS_METHODS

TP_MODES = ("exact", "blockwise", "duplicated")
BUFFER_LAYOUTS = ("owner_aligned", "megatron")
SCALE_MODES = ("moonlight", "spectral", "shape_scaling", "unit_rms_norm", "none")
QKV_GRANULARITIES = ("part", "group", "head")
MLA_GRANULARITIES = ("part", "head")
SCALAR_OPTIMIZERS = ("adam",)
ROUTER_OPTIMIZERS = ("adam", "muon")
STEP_OVERLAPS = ("auto", "none", "forward")


@dataclass
class MuonConfig(OptimizerConfig):
    """Configuration of :func:`megatron_muon.get_muon_optimizer`.

    Inherits every field of Megatron's ``OptimizerConfig`` (``lr``, ``weight_decay``,
    ``clip_grad``, ``bf16``/``fp16``, loss scaling, ``adam_*`` for the scalar parameters...).
    """

    optimizer: str = "muon"

    # --- the Muon update -------------------------------------------------------------
    muon_momentum: float = 0.95
    """Momentum coefficient mu of ``buf = mu * buf + grad``."""

    muon_nesterov: bool = True
    """Orthogonalize ``grad + mu * buf`` (Nesterov) instead of ``buf``."""

    muon_num_ns_steps: int = 5
    """Newton–Schulz iterations."""

    muon_coefficient_type: str = "quintic"
    """Newton–Schulz coefficients: 'quintic' (Keller Jordan's 3.4445, -4.7750, 2.0315 at
    every step; Megatron calls this set 'simple'), 'polar_express' (Amsel et al. 2025,
    one polynomial per step), 'megatron_quintic' (the per-step schedule Megatron-core
    calls 'quintic'), 'deepseek_v4' (DeepSeek-V4's hybrid: 8 quintic steps, then 2 of
    (2, -1.5, 0.5); use 10 steps), 'cans' (Grishina et al. 2025, Chebyshev-type) or
    'aol' (Turbo-Muon's set; 4 steps). Past the end of a schedule its last triple
    repeats. See ``megatron_muon.newton_schulz.COEFFICIENT_SETS``."""

    muon_scale_mode: str = "moonlight"
    """Update scale from the logical matrix's full shape (m, n): 'moonlight' =
    0.2*sqrt(max(m, n)) (matches AdamW's update RMS, so AdamW learning rates carry over),
    'spectral' = sqrt(max(m, n)), 'shape_scaling' = sqrt(max(1, m/n)) (Keller Jordan),
    'unit_rms_norm' = sqrt(m/n), 'none' = 1."""

    muon_extra_scale_factor: float = 1.0
    """Multiplies the update scale."""

    muon_ns_dtype: torch.dtype = torch.bfloat16
    """Compute dtype of Newton–Schulz (bf16 by default; fp32 for exactness checks)."""

    muon_ns_method: str = "auto"
    """Newton–Schulz iteration: 'standard' (on the matrix X), 'gram' (on the small Gram
    matrix X X^T, restarted midway; fewer FLOPs for wide matrices; with a 16-bit
    ``muon_ns_dtype`` it computes in fp16, whose range its bounded values fit and whose
    precision keeps it closer to float64 than bf16 standard NS) or 'auto' (the default:
    Gram for matrices with aspect ratio >= ``newton_schulz.GRAM_MIN_ASPECT``, standard
    otherwise; on a CPU, whose fp16 products are slow, standard throughout). The default
    by evidence: docs/study.md, "Newton–Schulz defaults". See ``megatron_muon.newton_schulz``."""

    muon_use_torch_compile: bool = False
    """Run the Newton–Schulz kernel through ``torch.compile`` (compiled on first use per
    shape; pays off on GPUs, see docs/benchmarks.md)."""

    muon_variance_reduction: Optional[float] = None
    """nanochat's variance reduction (NorMuon), with this beta2; None (default) = off. After
    Newton–Schulz, on the owner of each whole logical matrix ``O`` (logical ``(out, in)``
    orientation): ``v = mean(O**2)`` over the input dim if ``out >= in`` (one value per
    row), else over the output dim (one per column); a second moment ``s`` of that shape
    (zeros at first) becomes ``beta2 * s + (1 - beta2) * v``; the update is
    ``O * rsqrt(max(s, 1e-10))``, rescaled to keep ``O``'s Frobenius norm. Then the update
    scale. State: one fp32 vector per logical matrix, on its owner."""

    muon_cautious_weight_decay: bool = False
    """Cautious weight decay (nanochat): the decoupled decay ``lr * weight_decay * w`` of a
    Muon matrix applies only where the update ``u`` and the weight agree in sign
    (``u * w >= 0``, ``w`` before the step)."""

    muon_hyperball: bool = False
    """Muon-Hyperball (Wen et al. 2026): every Muon matrix and its update are kept at fixed
    Frobenius norms, ``W <- R * normalize(W - lr * R * normalize(U))``, ``U`` the
    orthogonalized update and ``R`` the matrix's radius (``muon_hyperball_radius``), instead
    of weight decay: the Muon matrices take none (the AdamW parameters keep
    ``weight_decay``). Exact on whole logical matrices (``muon_tp_mode='exact'``); the
    radius is optimizer state. See ``megatron_muon.hyperball``."""

    muon_hyperball_radius: Optional[float] = None
    """With ``muon_hyperball``: every matrix's radius as an RMS, ``R = radius * sqrt(rows *
    cols)``; None (default): each matrix's Frobenius norm when Hyperball first steps it."""

    muon_cpu_offload: bool = False
    """Keep the Muon momentum in (pinned, where CUDA is available) CPU memory; each
    pipeline chunk brings its momentum to the device just before its gather and writes it
    back right after, the copies overlapped with other chunks on side streams. With
    Megatron's ``optimizer_cpu_offload`` (and ``optimizer_offload_fraction=1.0``) the fp32
    master weights of the Muon matrices of bf16/fp16 models live in CPU memory too, staged
    to the device chunk by chunk the same way: weight decay, the update and QK-Clip run on
    the device, where each chunk's masters are also written into the model's parameters.
    AdamW's parameters keep their state on the device."""

    # --- distribution -------------------------------------------------------------------
    muon_tp_mode: str = "exact"
    """'exact': each logical matrix is gathered whole (across its data- and tensor-parallel
    pieces), orthogonalized once on one rank, and scattered back. 'blockwise': each
    tensor-parallel shard is orthogonalized on its own (Megatron's default, an
    approximation). 'duplicated': every tensor-parallel rank orthogonalizes the whole
    matrix for itself (exact, TP-times the work)."""

    muon_ns_max_ranks: int = 8
    """Multi-rank Newton–Schulz: a matrix whose NS cost alone exceeds a rank's mean load is
    orthogonalized by an aligned block of up to this many ranks together (a power of two;
    keep it within a node), its columns cut over them and its Gram matrix all-reduced each
    step (``megatron_muon.multirank_newton_schulz``). 1: every matrix on one rank."""

    muon_ns_intra_node_flops_per_byte: float = 0.5 * 989.4e12 / (0.8 * 450e9)
    """Multi-rank Newton–Schulz's price of a byte its blocking collectives send inside a
    node, in the NS FLOPs a rank does meanwhile: the plan spreads a matrix over ranks only
    where the FLOPs saved outweigh these bytes. Default: an H100 SXM (NS at half of 989
    TFLOP/s, NVLink 450 GB/s per direction at 80 %). 0 prices it by its FLOPs alone."""

    muon_ns_inter_node_flops_per_byte: float = 0.5 * 989.4e12 / (0.8 * 50e9)
    """As ``muon_ns_intra_node_flops_per_byte``, for ranks on different nodes (default:
    one 400 Gb/s NIC per GPU at 80 %)."""

    muon_comm_dtype: Optional[torch.dtype] = None
    """Dtype of the momentum and update pieces on the wire. None (default): the Newton–Schulz
    compute dtype ``muon_ns_dtype``, so fp32 Newton–Schulz is fp32 end to end and bf16
    Newton–Schulz keeps the bf16 wire (half the bytes). Set it to use another wire dtype."""

    muon_buffer_layout: str = "owner_aligned"
    """DDP buffer layout the Muon step expects. 'owner_aligned': every Muon matrix sits whole
    in the DP shard of the rank that orthogonalizes it (build DDP with
    ``full_param_layout=megatron_muon.owner_aligned_param_layout(config, chunk, ddp_config)``),
    so Muon moves only TP pieces inside the TP group and no optimizer bytes over DP.
    'megatron': Megatron's byte-level layout (matrices cut at shard bounds, pieces gathered
    over DP). If 'owner_aligned' is asked but DDP was built without the layout,
    ``get_muon_optimizer`` logs a warning and runs on Megatron's layout."""

    muon_chunk_numel: int = 64 * 1024 * 1024
    """Approximate number of matrix elements per pipeline chunk (summed over ranks)."""

    muon_max_inflight_chunks: int = 2
    """How many chunks' gathers may be in flight while one chunk computes."""

    muon_overlap_expert_ns: bool = True
    """Run the expert-parallel parameters' step (stacked per-expert Newton–Schulz) while the
    dense pipeline's first gather is in flight."""

    muon_step_overlap: str = "auto"
    """Where the Muon step runs. 'none': whole, inside ``optimizer.step()``. 'forward':
    ``step()`` does what needs every rank at once (non-finite check, grad norm and clipping,
    AdamW, the momentum, QK-Clip's max logits) and each chunk of Newton–Schulz work finishes
    when the next forward starts the parameter all-gather of a bucket group holding its
    matrices (needs DDP's ``overlap_param_gather``; not with Megatron-FSDP,
    ``muon_cpu_offload`` or FP8 / FP4 parameter gathers). 'auto': 'forward' when DDP overlaps the parameter all-gather,
    'none' otherwise. Both run the same arithmetic: the same bits."""

    muon_step_overlap_side_stream: bool = False
    """With ``muon_step_overlap`` 'forward' on CUDA: queue every pending chunk on a side
    stream as soon as ``step()`` returns, in the order the last forward synced its bucket
    groups, each bucket group's parameter sync waiting for its chunks' event (True); or run
    them on the forward's own stream from the parameter-sync hooks, as on the CPU (False).
    The same bits either way; on the CPU (no streams) the hooks run it. Off by default: on
    one H200 the side stream was no faster than the step whole, the hooks were
    (docs/benchmarks.md, "The GPU check"). Refused with ``muon_step_overlap='none'``."""

    # --- which parameters are Muon matrices -------------------------------------------------
    muon_split_qkv: bool = True
    """Orthogonalize a fused ``linear_qkv`` as separate Q, K and V matrices (Megatron's name)."""

    muon_qkv_granularity: str = "part"
    """How finely ``muon_split_qkv`` cuts: 'part' (one Q, one K, one V matrix across all
    heads, as Megatron-core and Moonlight do), 'group' (Q, K, V of each query group), 'head'
    (each query head and each K/V head on its own)."""

    muon_split_mla: bool = True
    """Orthogonalize the multi-latent-attention up-projections as their parts: q nope / q
    rope of ``linear_q_up_proj`` (or ``linear_q_proj``), k nope / v of ``linear_kv_up_proj``."""

    muon_mla_granularity: str = "part"
    """How finely ``muon_split_mla`` cuts: 'part' (each part across all heads) or 'head' (each
    part of each head)."""

    muon_split_glu: bool = False
    """Orthogonalize the gate and up halves of a gated ``linear_fc1`` as separate matrices.
    The loss is the same within the seeds' spread either way (docs/study.md, "Newton–Schulz
    defaults"); the step's time is not: halves of aspect >= 3 take Gram NS ('auto'), which
    makes DeepSeek-V3's experts' step about half (the deepseek_v3 recipe sets it), while a
    dense model whose halves stay below 3 pays more standard FLOPs for them."""

    muon_router_optimizer: str = "adam"
    """Optimizer of the MoE router weight: 'adam' (default) or 'muon'."""

    muon_scalar_optimizer: str = "adam"
    """Optimizer of the non-matrix parameters (embeddings, output layer, norms, biases)."""

    muon_exclude_patterns: Tuple[str, ...] = ()
    """``fnmatch`` patterns of parameter names that go to the scalar optimizer although
    they are matrices (e.g. ``('*.linear_proj.weight',)``)."""

    muon_param_filter: Optional[Callable[[str, torch.nn.Parameter], bool]] = field(default=None, compare=False)
    """Optional predicate ``(name, param) -> bool`` that overrides the default choice of
    Muon matrices entirely."""

    # --- non-finite gradients ------------------------------------------------------------
    muon_max_consecutive_skipped_steps: int = 10
    """A step whose gradients hold an inf or NaN is skipped on every rank (parameters and
    optimizer state untouched, ``update_successful=False``). After this many consecutive
    skipped steps the optimizer raises, naming a parameter with a non-finite gradient. With
    fp16's dynamic loss scaler, skips while the scaler can still lower the scale are the
    scaler's normal work and are not counted. 0 = never raise."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for problem in config_problems(self):
            raise ValueError(f"MuonConfig.{problem}")

    @property
    def comm_dtype(self) -> torch.dtype:
        """The dtype Muon's pieces travel in: ``muon_comm_dtype``, or ``muon_ns_dtype`` if None."""
        return self.muon_comm_dtype if self.muon_comm_dtype is not None else self.muon_ns_dtype


def _bad_number(value, minimum: float, strict: bool, integer: bool = False) -> bool:
    """True unless ``value`` is a finite number >= ``minimum`` (> with ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if integer and not isinstance(value, int):
        return True
    if not math.isfinite(value):
        return True
    return value <= minimum if strict else value < minimum


def offload_problems(cfg: Any) -> List[str]:
    """The CPU offload settings megatron_muon cannot run (``cfg``: a ``MuonConfig``, or
    Megatron-LM's arguments, read before its validation by ``support.optimizer_requirements``)."""
    problems = []
    offload, fraction = getattr(cfg, "optimizer_cpu_offload", False), getattr(cfg, "optimizer_offload_fraction", 1.0)
    if offload and not getattr(cfg, "muon_cpu_offload", False):
        problems.append(
            "optimizer_cpu_offload=True needs muon_cpu_offload=True (--muon-cpu-offload): megatron_muon "
            "offloads the Muon matrices' momentum and fp32 masters together"
        )
    if offload and fraction != 1.0:
        problems.append(
            f"optimizer_offload_fraction={fraction!r} is not supported with "
            "optimizer_cpu_offload: megatron_muon offloads the masters of every Muon matrix, not a "
            "fraction; set 1.0 (--optimizer-offload-fraction 1.0)"
        )
    return problems


def config_problems(cfg: MuonConfig):
    """Every invalid setting of ``cfg``, one line each: ``field=value ...: fix``.

    Run by ``MuonConfig.__post_init__`` (it raises on the first), so a bad value fails
    where the config is made, before any model is built.
    """
    choices = [
        ("muon_tp_mode", cfg.muon_tp_mode, TP_MODES),
        ("muon_ns_method", cfg.muon_ns_method, NS_METHODS),
        ("muon_scale_mode", cfg.muon_scale_mode, SCALE_MODES),
        ("muon_qkv_granularity", cfg.muon_qkv_granularity, QKV_GRANULARITIES),
        ("muon_mla_granularity", cfg.muon_mla_granularity, MLA_GRANULARITIES),
        ("muon_scalar_optimizer", cfg.muon_scalar_optimizer, SCALAR_OPTIMIZERS),
        ("muon_router_optimizer", cfg.muon_router_optimizer, ROUTER_OPTIMIZERS),
        ("muon_step_overlap", cfg.muon_step_overlap, STEP_OVERLAPS),
    ]
    choices.append(("muon_coefficient_type", cfg.muon_coefficient_type, tuple(COEFFICIENT_SETS)))
    for name, value, allowed in choices:
        if value not in allowed:
            yield f"{name}={value!r} is not supported; use one of {allowed}."
    # (field, minimum, strictly greater, integer, what it means)
    numbers = [
        ("muon_extra_scale_factor", 0.0, True, False, "a finite number > 0"),
        ("muon_num_ns_steps", 1, False, True, "an integer >= 1"),
        ("muon_chunk_numel", 1, False, True, "an integer >= 1"),
        ("muon_max_inflight_chunks", 1, False, True, "an integer >= 1"),
        ("muon_max_consecutive_skipped_steps", 0, False, True, "an integer >= 0 (0 = never raise)"),
        ("weight_decay", 0.0, False, False, "a finite number >= 0"),
        ("clip_grad", 0.0, False, False, "a finite number >= 0 (0 = no clipping)"),
        ("adam_eps", 0.0, True, False, "a finite number > 0"),
        ("initial_loss_scale", 0.0, True, False, "a finite number > 0"),
        ("min_loss_scale", 0.0, True, False, "a finite number > 0"),
        ("loss_scale_window", 1, False, False, "a number >= 1"),
        ("hysteresis", 1, False, True, "an integer >= 1"),
    ]
    for name, minimum, strict, integer, meaning in numbers:
        value = getattr(cfg, name)
        if _bad_number(value, minimum, strict, integer):
            yield f"{name}={value!r} is invalid; use {meaning}."
    for name in ("lr", "min_lr", "loss_scale"):
        value = getattr(cfg, name)
        if value is not None and _bad_number(value, 0.0, name == "loss_scale"):
            yield f"{name}={value!r} is invalid; use a finite number {'>' if name == 'loss_scale' else '>='} 0 (or None)."
    if not (isinstance(cfg.muon_momentum, (int, float)) and 0.0 <= cfg.muon_momentum < 1.0):
        yield f"muon_momentum={cfg.muon_momentum!r} is invalid; use a number in [0, 1)."
    ranks = cfg.muon_ns_max_ranks
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1 or ranks & (ranks - 1):
        yield f"muon_ns_max_ranks={ranks!r} is invalid; use a power of two >= 1 (1 = every matrix on one rank)."
    for name in ("muon_ns_intra_node_flops_per_byte", "muon_ns_inter_node_flops_per_byte"):
        value = getattr(cfg, name)
        if _bad_number(value, 0.0, False):
            yield f"{name}={value!r} is invalid; use a finite number >= 0 (0: by FLOPs alone)."
    vr = cfg.muon_variance_reduction
    if vr is not None and (isinstance(vr, bool) or not isinstance(vr, (int, float)) or not 0.0 <= vr < 1.0):
        yield f"muon_variance_reduction={vr!r} is invalid; use beta2 in [0, 1), or None (off)."
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
            yield f"{name}={value!r} is invalid; use a number in [0, 1)."
    for name in ("muon_ns_dtype", "muon_comm_dtype"):
        value = getattr(cfg, name)
        if value not in (torch.bfloat16, torch.float32, torch.float16) and not (
            name == "muon_comm_dtype" and value is None
        ):
            yield f"{name}={value!r} is not supported; use torch.bfloat16, torch.float32 or torch.float16" + (
                " (or None = muon_ns_dtype)." if name == "muon_comm_dtype" else "."
            )
    if cfg.muon_buffer_layout not in BUFFER_LAYOUTS:
        yield f"muon_buffer_layout={cfg.muon_buffer_layout!r} is not supported; use one of {BUFFER_LAYOUTS}."
    if cfg.fp16 and cfg.bf16:
        yield "fp16=True and bf16=True are both set; choose one precision (fp16 uses a loss scaler, bf16 does not)."
    if not isinstance(cfg.muon_exclude_patterns, (tuple, list)) or not all(
        isinstance(p, str) for p in cfg.muon_exclude_patterns
    ):
        yield (
            f"muon_exclude_patterns={cfg.muon_exclude_patterns!r} is invalid; use a tuple of "
            "fnmatch patterns, e.g. ('*.linear_proj.weight',)."
        )
    for problem in offload_problems(cfg):
        yield problem + "."
    if cfg.muon_step_overlap == "forward" and cfg.muon_cpu_offload:
        yield (
            "muon_step_overlap='forward' cannot run with muon_cpu_offload=True: the pending chunks would hold "
            "their offloaded momentum on the device through the forward; set muon_step_overlap='none' (or 'auto')."
        )
    if cfg.muon_step_overlap_side_stream and cfg.muon_step_overlap == "none":
        yield (
            "muon_step_overlap_side_stream=True needs the step in the next forward, but muon_step_overlap='none' "
            "runs it whole inside step(); set muon_step_overlap='forward' (or 'auto' with DDP's overlap_param_gather), "
            "or drop the side stream."
        )
    if cfg.muon_hyperball and cfg.muon_tp_mode != "exact":
        yield (
            f"muon_hyperball=True cannot be exact with muon_tp_mode={cfg.muon_tp_mode!r}: it needs each whole "
            "matrix's norm on one owner; set muon_tp_mode='exact' (--muon-tp-mode exact)."
        )
    if cfg.muon_hyperball and cfg.muon_cautious_weight_decay:
        yield (
            "muon_cautious_weight_decay=True has no effect with muon_hyperball=True: Hyperball's matrices take no "
            "weight decay (the radius replaces it); drop one of them."
        )
    radius = cfg.muon_hyperball_radius
    if radius is not None and (not cfg.muon_hyperball or _bad_number(radius, 0.0, True)):
        yield (
            f"muon_hyperball_radius={radius!r} is invalid; use a finite number > 0 (each matrix's RMS) with "
            "muon_hyperball=True, or None (each matrix's norm when Hyperball first steps it)."
        )
    if cfg.muon_param_filter is not None and not callable(cfg.muon_param_filter):
        yield f"muon_param_filter={cfg.muon_param_filter!r} is not callable; use a function (name, param) -> bool."


def update_scale(config: MuonConfig, rows: int, cols: int) -> float:
    """The factor that multiplies the orthogonalized update of an ``rows x cols`` matrix.

    ``rows, cols`` are the logical matrix's output and input sizes (full, across tensor
    parallelism; per expert; per Q/K/V part).
    """
    mode = config.muon_scale_mode
    if mode == "moonlight":
        scale = 0.2 * max(rows, cols) ** 0.5
    elif mode == "spectral":
        scale = max(rows, cols) ** 0.5
    elif mode == "shape_scaling":
        scale = max(1.0, rows / cols) ** 0.5
    elif mode == "unit_rms_norm":
        scale = (rows / cols) ** 0.5
    else:
        scale = 1.0
    return scale * config.muon_extra_scale_factor


def field_docstrings(cls: type) -> Dict[str, str]:
    """The docstring under each dataclass field of ``cls`` and its bases (read from the
    source): the help of the generated ``--muon-*`` flags and docs/usage.md's field table."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
