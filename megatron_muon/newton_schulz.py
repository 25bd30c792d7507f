"""Newton–Schulz orthogonalization's data and costs: the coefficient sets, the choice
between the standard and the Gram iteration, and their FLOP counts. The kernels themselves
are the orthogonalization stage of Muon's rule (``rule.py``: ``newton_schulz``).

Muon replaces a momentum matrix ``G = U S V^T`` by (an approximation of) its polar factor
``U V^T``, using only matrix products:

1. Scale ``G`` by its Frobenius norm (taken in fp32), so every singular value lies in ``[0, 1]``.
2. Repeat ``steps`` times: ``A = X X^T``, ``B = b*A + c*A A``, ``X = a*X + B X``: each
   singular value ``s`` becomes ``p(s) = a s + b s^3 + c s^5``, the singular vectors stay.

The coefficients ``(a, b, c)`` are data (:data:`COEFFICIENT_SETS`), possibly one triple per
step. A tall ``G`` is transposed so that ``X X^T`` is the smaller Gram matrix.

**Gram Newton–Schulz** (``method="gram"``) computes the same polynomial with fewer FLOPs
for wide matrices: every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in
``R_0 = X_0 X_0^T``, so it iterates on the small ``k x k`` matrices
(``P = a I + b R + c R^2; Q <- P Q; R <- P R P``) and touches the ``k x l`` matrix only to
form ``R`` and to apply ``Q``. It restarts every :data:`GRAM_RESTART_STEPS` steps (``X``
materialised, ``R`` recomputed, ``Q`` reset) and, with a 16-bit compute dtype, computes in
fp16 (its values are bounded; fp16 rounds eightfold finer than bf16). ``method="auto"``
picks it for aspect ratios of at least :data:`GRAM_MIN_ASPECT`. docs/design.md
("Newton–Schulz numerics") has the measurements behind these choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

__all__ = [
    "COEFFICIENT_SETS",
    "CoefficientSet",
    "GRAM_MIN_ASPECT",
    "GRAM_RESTART_STEPS",
    "NS_METHODS",
    "choose_method",
    "method_for_device",
    "newton_schulz_flops",
    "resolve_coefficients",
]

Triple = Tuple[float, float, float]

NS_METHODS = ("standard", "gram", "auto")
"""Values of ``rule.newton_schulz(method=...)`` and ``MuonConfig.muon_ns_method``."""

GRAM_RESTART_STEPS = 3
"""Gram NS restarts (materialises ``X``, recomputes ``R``, resets ``Q``) after this many
steps. With 5 quintic steps, restarting after 3 kept the bf16 result closest to fp32 on
gaussian, low-rank and ill-conditioned inputs (after 2: ~2x the error on ill-conditioned
ones; never: up to 15x); ``Q`` then stays below 3.4445^3 ~ 41."""

GRAM_MIN_ASPECT = 3.0
"""``method="auto"`` uses Gram NS for matrices with ``max(m, n) / min(m, n) >=`` this.
Measured with ``tools/bench/newton_schulz.py`` on the CPU (docs/benchmarks.md): Gram was
1.2-1.3x slower at aspect 2, even at about 3 and faster above, although its counted FLOPs
break even already at 1.5 (the small square products run further from peak)."""


@dataclass(frozen=True)
class CoefficientSet:
    """A named schedule of ``(a, b, c)`` triples, one per Newton–Schulz step.

    Step ``i`` uses ``steps[i]``; once the schedule is exhausted its last triple repeats.
    """

    name: str
    steps: Tuple[Triple, ...]

    def __post_init__(self) -> None:
        if not self.steps or any(len(t) != 3 for t in self.steps):
            raise ValueError(f"CoefficientSet {self.name!r} needs at least one (a, b, c) triple.")
        # Normalise to plain float tuples so equal sets compare and hash equal.
        object.__setattr__(self, "steps", tuple(tuple(float(v) for v in t) for t in self.steps))

    def for_step(self, i: int) -> Triple:
        """The triple of step ``i`` (0-based); the last triple repeats past the end."""
        return self.steps[min(i, len(self.steps) - 1)]

    def schedule(self, num_steps: int) -> Tuple[Triple, ...]:
        """The triples of the first ``num_steps`` steps."""
        return tuple(self.for_step(i) for i in range(num_steps))


def _with_safety(raw: Tuple[Triple, ...], factor: float) -> Tuple[Triple, ...]:
    # Polar Express uses p(s / f) instead of p(s), i.e. (a/f, b/f^3, c/f^5), for every
    # polynomial but the last, so bf16 rounding that nudges a singular value slightly
    # above its bound cannot make the next polynomial blow it up.
    scaled = tuple((a / factor, b / factor**3, c / factor**5) for a, b, c in raw[:-1])
    return scaled + raw[-1:]


_KELLER_JORDAN = ((3.4445, -4.7750, 2.0315),)

# Polar Express, arXiv 2505.16932, Algorithm 1: the optimal quintic for each step on
# [l, u] with l = 1e-3, u = 1 and cushioning, as published (before the safety division).
# The published list ends with (1.875, -1.25, 0.375), the limit polynomial once l ~ u.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

# modded-nanogpt's per-step schedule; Megatron-core / emerging-optimizers call it "quintic".
_MEGATRON_QUINTIC = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# DeepSeek-V4's hybrid schedule (DeepSeek-V4 technical report,
# https://huggingface.co/deepseek-ai/DeepSeek-V4-Pro/resolve/main/DeepSeek_V4.pdf): eight
# steps of Keller Jordan's fast-growing quintic take the small singular values up into its
# band, then two steps of (2, -1.5, 0.5) settle them at one. That polynomial has p(1) = 1
# and p'(1) = 0, so values in the band converge to one instead of oscillating around it.
# It is meant for 10 steps (``muon_num_ns_steps=10``); with fewer, only the quintic runs.
_DEEPSEEK_V4 = _KELLER_JORDAN * 8 + ((2.0, -1.5, 0.5),) * 2

# CANS (Grishina, Smirnov, Rakhuba, "Accelerating Newton-Schulz Iteration for
# Orthogonalization via Chebyshev-type Polynomials", arXiv 2506.10935): per-step quintics
# from a Remez fit on an interval that shrinks adaptively, as generated by the authors'
# polynomials.py (github.com/GrishKate/accelerating_orthogonalization) and listed by
# emerging-optimizers 0.3.0 (muon_utils._COEFFICIENT_SETS["cans"]) for 5 steps.
_CANS = (
    (8.4703, -25.1081, 18.6293),
    (4.1828, -3.1087, 0.5806),
    (3.9619, -2.9541, 0.5630),
    (3.2866, -2.4647, 0.5074),
    (2.2737, -1.6447, 0.4162),
)

# AOL / Turbo-Muon (Boissin et al., github.com/thib-s/flash-newton-schulz,
# newton_schulz_triton.py): four per-step quintics tuned for inputs preconditioned by
# Almost-Orthogonal-Layer rescaling (Prach & Lampert, "Almost-Orthogonal Layers for
# Efficient General-Purpose Lipschitz Networks", ECCV 2022, arXiv 2208.03160), which
# starts closer to orthogonal and so needs one step less. Like emerging-optimizers 0.3.0
# we apply the coefficients to the Frobenius-normalised input without that
# preconditioning. Past step 4 our schedules repeat the last triple (emerging-optimizers
# cycles back to the first for 'aol'); the recommended count for this set is 4 steps.
_AOL = (
    (4.0098, -7.0585, 2.4635),
    (3.4585, -5.5479, 2.5959),
    (2.7573, -3.2939, 1.4254),
    (2.7215, -3.0494, 1.3169),
)

COEFFICIENT_SETS: Dict[str, CoefficientSet] = {
    "quintic": CoefficientSet("quintic", _KELLER_JORDAN),
    # Megatron-core's name for Keller Jordan's set.
    "simple": CoefficientSet("simple", _KELLER_JORDAN),
    "polar_express": CoefficientSet("polar_express", _with_safety(_POLAR_EXPRESS_RAW, 1.01)),
    "megatron_quintic": CoefficientSet("megatron_quintic", _MEGATRON_QUINTIC),
    "deepseek_v4": CoefficientSet("deepseek_v4", _DEEPSEEK_V4),
    "cans": CoefficientSet("cans", _CANS),
    "aol": CoefficientSet("aol", _AOL),
}
"""Known coefficient sets by name (the values accepted by ``MuonConfig.muon_coefficient_type``)."""


def resolve_coefficients(coefficients: Union[str, CoefficientSet]) -> CoefficientSet:
    """Look a coefficient set up by name, or pass a :class:`CoefficientSet` through."""
    if isinstance(coefficients, CoefficientSet):
        return coefficients
    try:
        return COEFFICIENT_SETS[coefficients]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown Newton–Schulz coefficient set {coefficients!r}; "
            f"use one of {tuple(COEFFICIENT_SETS)} or pass a CoefficientSet."
        ) from None


def choose_method(m: int, n: int, method: str = "auto") -> str:
    """The iteration ``newton_schulz(method=method)`` runs on an ``m x n`` matrix:
    ``"auto"`` resolves by aspect ratio (:data:`GRAM_MIN_ASPECT`)."""
    if method not in NS_METHODS:
        raise ValueError(f"Newton–Schulz method {method!r} is unknown; use one of {NS_METHODS}.")
    if method != "auto":
        return method
    return "gram" if max(m, n) >= GRAM_MIN_ASPECT * min(m, n) else "standard"


def method_for_device(method: str, device: Optional[torch.device]) -> str:
    """The iteration ``method`` means on ``device``: ``"auto"`` runs Gram NS only where
    16-bit matrix products are fast (an accelerator); on a CPU, which has no fp16 matrix
    instructions (fp16 products there run two orders of magnitude below bf16's), it is
    ``"standard"``. Explicit methods are kept."""
    if method == "auto" and device is not None and torch.device(device).type == "cpu":
        return "standard"
    return method


def newton_schulz_flops(m: int, n: int, steps: int = 5, batch: int = 1, method: str = "standard") -> int:
    """Floating-point operations of one :func:`newton_schulz` call on ``batch`` ``m x n`` matrices.

    Counts only the matmuls, two FLOPs per multiply-add, with ``k = min(m, n)`` and
    ``l = max(m, n)``; the elementwise terms and the normalisation are ``O(k l)`` and left
    out. Symmetric in ``(m, n)`` since tall inputs are transposed.

    * standard, per step: ``X X^T`` (``2 k^2 l``), ``A A`` (``2 k^3``), ``B X`` (``2 k^2 l``);
    * gram, per restart segment of ``L`` steps: ``R = X X^T`` and ``X = Q X`` (``2 k^2 l``
      each) and ``4 L - 3`` square products (``2 k^3`` each): ``R R`` every step, ``P Q``
      from the second step on, ``P R P`` on all but the last.
    """
    k, l = min(m, n), max(m, n)
    method = choose_method(m, n, method)
    if method == "standard":
        return batch * steps * (4 * k * k * l + 2 * k**3)
    total = 0
    for start in range(0, steps, GRAM_RESTART_STEPS):
        length = min(GRAM_RESTART_STEPS, steps - start)
        total += 4 * k * k * l + (4 * length - 3) * 2 * k**3
    return batch * total
