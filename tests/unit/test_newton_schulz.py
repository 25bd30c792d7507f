"""Tests of the Newton–Schulz kernel (``megatron_muon.rule.newton_schulz``, its coefficient
sets and costs in ``megatron_muon.newton_schulz``).

Newton–Schulz maps each singular value ``s`` of the Frobenius-normalised input through the
scalar composition ``p_k(...p_1(s))`` with ``p_i(s) = a_i s + b_i s^3 + c_i s^5`` and keeps
the singular vectors. Most checks build ``G = U diag(s) V^T`` with known ``U, V`` so every
output singular value can be paired with the input one it came from (``U^T X V``).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_muon.newton_schulz import (
    COEFFICIENT_SETS,
    GRAM_MIN_ASPECT,
    CoefficientSet,
    choose_method,
    newton_schulz_flops,
)
from megatron_muon.rule import newton_schulz

SHAPES = [(64, 64), (32, 96), (96, 32), (1, 50)]
CONDS = [1e0, 1e2, 1e4, 1e6]
SETS = ["quintic", "polar_express", "megatron_quintic"]
F32 = torch.float32

# Largest value the 5-step composition takes anywhere on [0, 1] (scalar sweep, 2e5 points):
# quintic 1.2024, polar_express 1.1236, megatron_quintic 1.1450. A little slack on top.
UPPER = {"quintic": 1.21, "polar_express": 1.13, "megatron_quintic": 1.15}
LOWER = 0.68
# The band holds only for singular values that are not tiny *relative to the Frobenius
# norm* (the iteration never sees s_max, only s / ||G||_F): below that a small value grows
# at most ~a per step (3.4445^5 ~ 490 for quintic) and is still on its way up after 5
# steps. The scalar sweep says every set reaches >= 0.68 from 1.5e-3 on; we use 2e-3.
# For 64 equal-ish values that is s >= ~1.6e-2 s_max, so "s >= 1e-3 s_max" is not enough.
CONVERGED = 2e-3


def make_matrix(m: int, n: int, cond: float, seed: int = 0):
    """``G = U diag(s) V^T`` in fp32 with log-spaced ``s`` from 1 to ``1/cond``; returns G, U, V, s (fp64)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
    return ((U * s) @ V.T).float(), U, V, s


def scalar_map(x: torch.Tensor, name: str, steps: int) -> torch.Tensor:
    for a, b, c in COEFFICIENT_SETS[name].schedule(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def paired_singular_values(X: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Diagonal of ``U^T X V``: the output value along each input singular direction."""
    return torch.diagonal(U.T @ X.double() @ V)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double())).item()


# --- singular values ----------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("cond", CONDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_singular_values_in_band(shape, cond, name):
    G, U, V, s = make_matrix(*shape, cond)
    X = newton_schulz(G, 5, name, F32)
    assert X.shape == G.shape and X.dtype == G.dtype and torch.isfinite(X).all()

    out = paired_singular_values(X, U, V)
    s_norm = s / torch.linalg.norm(s)
    # Singular vectors are kept: U^T X V is diagonal, with the scalar map on the diagonal.
    off = U.T @ X.double() @ V - torch.diag(out)
    assert off.abs().max() < 1e-4
    torch.testing.assert_close(out, scalar_map(s_norm, name, 5), atol=1e-4, rtol=0)

    svals = torch.linalg.svdvals(X.double())
    assert svals.max() <= UPPER[name]
    converged = out[s_norm >= CONVERGED]
    assert converged.numel() > 0
    assert converged.min() >= LOWER, (converged.min(), s_norm[s_norm >= CONVERGED].min())


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gaussian_matrix_band(shape, name):
    # Random Gaussian matrices have a spread spectrum down to ~0 (square case); pair the
    # output values with the input directions through G's own SVD.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    U, s, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    out = paired_singular_values(newton_schulz(G, 5, name, F32), U, Vh.T)
    s_norm = s / s.norm()
    assert out.max() <= UPPER[name]
    assert out[s_norm >= CONVERGED].min() >= LOWER


@pytest.mark.parametrize("cond", [1e1, 1e2])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"{s[0]}x{s[1]}")
def test_polar_express_closer_to_one_than_quintic(shape, cond):
    # A spread spectrum: with all singular values equal (cond 1) the comparison hinges on
    # where one single point lands, and quintic can land closer by luck (32x96: 1.019 vs 0.956).
    G, U, V, _ = make_matrix(*shape, cond)
    err = {}
    for name in ("quintic", "polar_express"):
        out = paired_singular_values(newton_schulz(G, 5, name, F32), U, V)
        err[name] = ((out - 1).abs().mean().item(), (out - 1).abs().max().item())
    assert err["polar_express"][0] < err["quintic"][0], err
    assert err["polar_express"][1] < err["quintic"][1], err


def test_orthogonality_improves_and_polar_factor():
    G, U, V, _ = make_matrix(32, 96, 10.0)
    eye = torch.eye(32, dtype=torch.float64)

    def ortho_err(X):
        X = X.double()
        return torch.linalg.norm(X @ X.T - eye).item()

    # The input at its most favourable scale (largest singular value exactly one).
    base = ortho_err(G / torch.linalg.matrix_norm(G, ord=2))
    for name in SETS:
        assert ortho_err(newton_schulz(G, 5, name, F32)) < 0.5 * base
    # Polar Express converges to U V^T: 10 steps, condition number 10 (observed ~1e-6).
    assert rel(newton_schulz(G, 10, "polar_express", F32), U @ V.T) < 1e-4
    assert rel(newton_schulz(G.T.contiguous(), 10, "polar_express", F32), V @ U.T) < 1e-4


# --- shapes, batching, dtypes, zeros ---------------------------------------------------------


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_batched_equals_looped(shape):
    stack = torch.randn(5, *shape, generator=torch.Generator().manual_seed(2))
    stack[1] *= 1e-3  # each member is normalised by its own norm
    batched = newton_schulz(stack, 5, "polar_express", F32)
    looped = torch.stack([newton_schulz(x, 5, "polar_express", F32) for x in stack])
    torch.testing.assert_close(batched, looped, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tall_equals_transposed_wide(dtype):
    W = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))
    wide = newton_schulz(W, 5, "quintic", dtype)
    tall = newton_schulz(W.T.contiguous(), 5, "quintic", dtype)
    torch.testing.assert_close(tall, wide.T, atol=1e-6, rtol=0)
    stacked = newton_schulz(torch.stack([W.T, W.T]), 5, "quintic", dtype)
    torch.testing.assert_close(stacked[1], wide.T, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_zero_input_gives_zero(shape, dtype):
    out = newton_schulz(torch.zeros(shape), 5, "polar_express", dtype)
    assert torch.equal(out, torch.zeros(shape))
    stack = torch.randn(3, *shape, generator=torch.Generator().manual_seed(4))
    stack[1] = 0
    out = newton_schulz(stack, 5, "quintic", dtype)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(shape))
    assert out[0].abs().max() > 0.1 and out[2].abs().max() > 0.1


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_close_to_fp32(shape, name):
    # bf16 rounds every GEMM result to 8 mantissa bits and the polynomials amplify that
    # noise (steep slopes near zero, oscillation in the band): 0.5-2% observed on these
    # inputs, of which ~0.2-0.7% is just rounding the input.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    assert rel(newton_schulz(G, 5, name, torch.bfloat16), newton_schulz(G, 5, name, F32)) < 3e-2


def test_output_dtype_follows_input():
    G = torch.randn(8, 12, generator=torch.Generator().manual_seed(6))
    assert newton_schulz(G).dtype == torch.float32  # bf16 compute, fp32 result
    assert newton_schulz(G.bfloat16(), compute_dtype=F32).dtype == torch.bfloat16
    assert newton_schulz(G.double(), compute_dtype=torch.float64).dtype == torch.float64


def test_zero_steps_returns_normalised_input():
    G = torch.randn(8, 12, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(newton_schulz(G, 0, compute_dtype=F32), G / torch.linalg.norm(G))


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 2, 3, 4)])
def test_rejects_wrong_rank(bad):
    with pytest.raises(ValueError, match="2-D matrix or 3-D stack"):
        newton_schulz(bad)


def test_default_path_never_compiles(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("torch.compile must not be used unless compiled=True")

    monkeypatch.setattr(torch, "compile", boom)
    newton_schulz(torch.randn(8, 12))


@pytest.mark.slow  # torch.compile (inductor) takes about 15 s on a CPU
def test_compiled_matches_eager():
    # Inductor on the CPU (gcc): each compile takes about ten seconds, so one small stack
    # (the batched kernel) and one method; tests/cuda compiles both methods on a GPU.
    g = torch.Generator().manual_seed(8)
    for G in (torch.randn(2, 40, 12, generator=g),):
        for method in ("gram",):
            eager = newton_schulz(G, 5, "polar_express", F32, method=method)
            compiled = newton_schulz(G, 5, "polar_express", F32, compiled=True, method=method)
            assert rel(compiled, eager) < 1e-5, method


# --- FLOPs ---------------------------------------------------------------------------------


def test_flops():
    # k = min, l = max; per step 2 k^2 l (X X^T) + 2 k^3 (A A) + 2 k^2 l (B X).
    assert newton_schulz_flops(64, 64) == 5 * (4 * 64**3 + 2 * 64**3)
    assert newton_schulz_flops(32, 96, steps=3) == 3 * (4 * 32 * 32 * 96 + 2 * 32**3)
    assert newton_schulz_flops(1, 50, steps=1) == 4 * 50 + 2
    assert newton_schulz_flops(32, 96, 5, batch=7) == 7 * newton_schulz_flops(32, 96, 5)
    for m, n in [(32, 96), (1, 50), (4096, 11008)]:
        assert newton_schulz_flops(m, n) == newton_schulz_flops(n, m)
    assert isinstance(newton_schulz_flops(4096, 11008), int)


# --- coefficient sets ----------------------------------------------------------------------


def test_coefficient_set_names_and_values():
    assert {"quintic", "simple", "polar_express", "megatron_quintic"} <= set(COEFFICIENT_SETS)
    assert COEFFICIENT_SETS["quintic"].steps == ((3.4445, -4.7750, 2.0315),)
    assert COEFFICIENT_SETS["simple"].steps == COEFFICIENT_SETS["quintic"].steps
    mq = COEFFICIENT_SETS["megatron_quintic"]
    assert len(mq.steps) == 5 and mq.steps[0] == (4.0848, -6.8946, 2.9270)
    assert mq.for_step(4) == mq.for_step(11) == (2.8366, -3.0525, 1.2012)

    pe = COEFFICIENT_SETS["polar_express"]
    assert len(pe.steps) == 8
    # First published polynomial with the 1.01 safety division (a/1.01, b/1.01^3, c/1.01^5).
    expected = (8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3, 17.300387312530933 / 1.01**5)
    assert pe.steps[0] == pytest.approx(expected)
    assert pe.steps[0] == pytest.approx((8.2052, -22.9019, 16.4607), abs=1e-4)
    # The last one (the limit polynomial) is not divided and repeats past the end.
    assert pe.steps[-1] == (1.875, -1.25, 0.375) == pe.for_step(20)


def test_named_sets_of_other_projects():
    ds = COEFFICIENT_SETS["deepseek_v4"]
    assert ds.schedule(10) == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
    assert COEFFICIENT_SETS["cans"].steps[0] == (8.4703, -25.1081, 18.6293) and len(COEFFICIENT_SETS["cans"].steps) == 5
    assert COEFFICIENT_SETS["aol"].steps[-1] == (2.7215, -3.0494, 1.3169) and len(COEFFICIENT_SETS["aol"].steps) == 4
    # The same numbers as emerging-optimizers (Megatron-core's Muon backend) where it is installed.
    eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.muon_utils")
    for ours, theirs in (("deepseek_v4", "deepseekv4"), ("cans", "cans"), ("aol", "aol")):
        assert COEFFICIENT_SETS[ours].steps == tuple(tuple(t) for t in eo._COEFFICIENT_SETS[theirs])


@pytest.mark.parametrize("name,steps", [("deepseek_v4", 10), ("cans", 5), ("aol", 4)])
def test_named_sets_orthogonalize(name, steps):
    # Every value that is not tiny relative to the norm ends near one; DeepSeek-V4's two
    # settling steps (p(1) = 1, p'(1) = 0) take it much closer than the quintic band.
    G, U, V, s = make_matrix(64, 96, 1e2)
    out = paired_singular_values(newton_schulz(G, steps, name, F32), U, V)
    converged = (s / s.norm()) >= 2e-2
    lo, hi = {"deepseek_v4": (0.95, 1.05), "cans": (0.6, 1.3), "aol": (0.6, 1.3)}[name]
    assert out[converged].min() > lo and out[converged].max() < hi


def test_unknown_coefficient_name_raises():
    with pytest.raises(ValueError) as info:
        newton_schulz(torch.randn(4, 6), 5, "cubic")
    for name in COEFFICIENT_SETS:
        assert name in str(info.value)


def test_coefficient_set_object_can_be_passed():
    G, U, V, s = make_matrix(16, 24, 10.0)
    same = CoefficientSet("mine", COEFFICIENT_SETS["polar_express"].steps)
    torch.testing.assert_close(
        newton_schulz(G, 5, same, F32), newton_schulz(G, 5, "polar_express", F32), atol=0, rtol=0
    )
    # The classic cubic Newton–Schulz, 1.5 s - 0.5 s^3, converges to U V^T slowly but surely.
    cubic = CoefficientSet("cubic", ((1.5, -0.5, 0.0),))
    assert cubic.for_step(0) == cubic.for_step(99)
    out = paired_singular_values(newton_schulz(G, 30, cubic, F32), U, V)
    s_norm = s / s.norm()
    expected = s_norm.clone()
    for _ in range(30):
        expected = 1.5 * expected - 0.5 * expected**3
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        CoefficientSet("empty", ())


# --- Gram Newton–Schulz --------------------------------------------------------------------


def _inputs(m: int, n: int, seed: int = 0):
    """A gaussian, a nearly low-rank (rank 16 plus 1 % noise) and an ill-conditioned
    (singular values log-spaced over 4 decades) ``m x n`` matrix: the momentum matrices
    Muon sees lie between these."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(m, n, generator=g)
    low_rank = torch.randn(m, 16, generator=g) @ torch.randn(16, n, generator=g) + 1e-2 * torch.randn(m, n, generator=g)
    ill, _, _, _ = make_matrix(m, n, 1e4, seed)
    return {"gaussian": gauss, "low_rank": low_rank, "ill_conditioned": ill}


@pytest.mark.parametrize("shape", [(64, 96), (96, 32), (3, 48, 80)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["quintic", "polar_express", "deepseek_v4"])
def test_gram_equals_standard_in_fp32(shape, name):
    # The same polynomial, only evaluated through X X^T: fp32 results agree to rounding.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    steps = 10 if name == "deepseek_v4" else 5
    gram = newton_schulz(G, steps, name, F32, method="gram")
    assert gram.shape == G.shape and gram.dtype == G.dtype
    assert rel(gram, newton_schulz(G, steps, name, F32)) < 1e-5


@pytest.mark.parametrize("name", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (96, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gram_16bit_as_close_to_fp32_as_standard_bf16(shape, name):
    for kind, G in _inputs(*shape).items():
        exact = newton_schulz(G, 5, name, F32)
        standard = rel(newton_schulz(G, 5, name, torch.bfloat16), exact)
        gram = rel(newton_schulz(G, 5, name, torch.bfloat16, method="gram"), exact)
        assert gram <= standard, (kind, gram, standard)


def test_gram_16bit_batched_stack_with_spread_singular_values():
    # A [B, m, n] stack mixing the three kinds of input, each matrix normalised on its own.
    stack = torch.stack(list(_inputs(64, 256, seed=3).values()))
    exact = newton_schulz(stack, 5, "quintic", F32)
    for i in range(stack.size(0)):
        standard = rel(newton_schulz(stack, 5, "quintic", torch.bfloat16)[i], exact[i])
        gram = rel(newton_schulz(stack, 5, "quintic", torch.bfloat16, method="gram")[i], exact[i])
        assert gram <= standard, (i, gram, standard)


def test_gram_16bit_rank_deficient_many_steps():
    # An exactly rank-deficient input over ten steps: rounding leaves R with tiny negative
    # eigenvalues that grow by a^2 per step unless R is recomputed from the stored X (why the
    # restart materialises X; re-forming R = Q R_0 Q^T from the factors went to inf/NaN here,
    # even in fp32). Finite, and no farther from fp32 than bf16 standard NS.
    g = torch.Generator().manual_seed(4)
    G = torch.randn(48, 8, generator=g) @ torch.randn(8, 192, generator=g)
    exact = newton_schulz(G, 10, "deepseek_v4", F32)
    assert torch.isfinite(newton_schulz(G, 10, "deepseek_v4", F32, method="gram")).all()
    gram = newton_schulz(G, 10, "deepseek_v4", torch.bfloat16, method="gram")
    assert torch.isfinite(gram).all()
    assert rel(gram, exact) <= rel(newton_schulz(G, 10, "deepseek_v4", torch.bfloat16), exact)


def test_gram_batched_equals_looped_and_handles_zero():
    stack = torch.randn(4, 40, 120, generator=torch.Generator().manual_seed(2))
    stack[2] = 0
    batched = newton_schulz(stack, 5, "quintic", F32, method="gram")
    looped = torch.stack([newton_schulz(m, 5, "quintic", F32, method="gram") for m in stack])
    torch.testing.assert_close(batched, looped, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(batched).all() and batched[2].abs().max() == 0
    # bf16 compute, tall stack: finite and the right shape/dtype.
    out = newton_schulz(stack.mT.bfloat16(), 5, "quintic", torch.bfloat16, method="gram")
    assert out.shape == (4, 120, 40) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_auto_method_by_aspect_ratio():
    wide = int(GRAM_MIN_ASPECT * 32)
    assert choose_method(32, wide) == choose_method(wide, 32) == "gram"
    assert choose_method(32, wide - 1) == "standard"
    assert choose_method(32, 32, "gram") == "gram" and choose_method(32, 320, "standard") == "standard"
    G = torch.randn(32, wide)
    assert torch.equal(newton_schulz(G, 5, method="auto"), newton_schulz(G, 5, method="gram"))
    with pytest.raises(ValueError, match="standard"):
        newton_schulz(G, 5, method="fast")


def test_auto_is_standard_on_a_cpu_device_only():
    """A CPU has no fp16 matrix instructions, so 'auto' runs standard NS there (the
    optimizer resolves it for its device); explicit methods are kept everywhere."""
    from megatron_muon.newton_schulz import method_for_device

    assert method_for_device("auto", torch.device("cpu")) == "standard"
    assert method_for_device("auto", torch.device("cuda", 0)) == "auto"
    assert method_for_device("auto", None) == "auto"  # no device: the aspect rule (the scale model's GPUs)
    assert method_for_device("gram", torch.device("cpu")) == "gram"
    assert method_for_device("standard", torch.device("cuda")) == "standard"


def test_gram_flops():
    k, l = 64, 320
    # Segments of 3 and 2 steps: each reads X twice (2 k^2 l each) and does 4L - 3 square products.
    assert newton_schulz_flops(k, l, 5, method="gram") == 2 * (4 * k * k * l) + (9 + 5) * 2 * k**3
    assert newton_schulz_flops(l, k, 5, batch=3, method="gram") == 3 * newton_schulz_flops(k, l, 5, method="gram")
    assert newton_schulz_flops(k, l, 1, method="gram") == 4 * k * k * l + 2 * k**3
    assert newton_schulz_flops(k, l, 5, method="auto") == newton_schulz_flops(k, l, 5, method="gram")
    # Wide matrices: about 2/3 of the standard FLOPs at aspect 4, under 0.6 from about 6.
    for aspect, bound in ((4, 0.67), (6, 0.59), (16, 0.48)):
        ratio = newton_schulz_flops(k, aspect * k, method="gram") / newton_schulz_flops(k, aspect * k)
        assert ratio <= bound, (aspect, ratio)


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("steps", [0, 1, 3, 5, 10])
@pytest.mark.parametrize("shape", [(48, 192), (192, 48), (2, 32, 96)], ids=lambda s: "x".join(map(str, s)))
def test_flops_match_executed_matmuls(method, steps, shape):
    # newton_schulz_flops counts exactly the matmuls the kernel runs, no more, no fewer.
    from torch.utils.flop_counter import FlopCounterMode

    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    for dtype in (F32, torch.bfloat16):
        with FlopCounterMode(display=False) as counter:
            newton_schulz(G, steps, "quintic", dtype, method=method)
        batch = shape[0] if len(shape) == 3 else 1
        expected = newton_schulz_flops(shape[-2], shape[-1], steps, batch=batch, method=method)
        assert counter.get_total_flops() == expected, (dtype, counter.get_flop_counts())
