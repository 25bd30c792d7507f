"""Split Newton–Schulz all-reduces only the block upper triangle of the symmetric Gram
matrix (``megatron_muon.split_newton_schulz``): packing, unpacking and the byte count."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("k", [1, 3, 16, 17, 64, 130])
def test_packed_upper_triangle_rebuilds_the_gram_matrix(k):
    from megatron_muon.split_newton_schulz import _gram_row_blocks, _pack_upper, _unpack_symmetric, gram_upper_numel

    X = torch.randn(k, 3 * k + 1, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    A = X @ X.mT
    packed = _pack_upper(A)
    assert packed.numel() == gram_upper_numel(k)
    rebuilt = _unpack_symmetric(packed, k)
    for start, end in _gram_row_blocks(k):  # sent as computed: the diagonal block and right of it
        assert torch.equal(rebuilt[start:end, start:], A[start:end, start:])
        assert torch.equal(rebuilt[start:end, :start], A[:start, start:end].mT)  # mirrored
    assert torch.allclose(rebuilt, A, rtol=1e-12, atol=1e-12)
    # The sum of packed partials is the packed sum: what the all-reduce relies on.
    Y = torch.randn(k, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    both = _unpack_symmetric(_pack_upper(A) + _pack_upper(Y @ Y.mT), k)
    assert torch.allclose(both, A + Y @ Y.mT, rtol=1e-12, atol=1e-12)


def test_upper_triangle_is_about_half_of_the_matrix():
    from megatron_muon.split_newton_schulz import GRAM_ROW_BLOCKS, gram_upper_numel, split_traffic

    k = 7168  # DeepSeek-V3's hidden size: the attention out-projection's short side
    n = GRAM_ROW_BLOCKS
    assert gram_upper_numel(k) == k * k * (n + 1) // (2 * n)
    full = 5 * 2 * 7 * k * k * 4 // 8  # five steps of a ring all-reduce of the whole fp32 A over 8 ranks
    assert split_traffic(7168, 16384, 5, 8, 2)["all_reduce"] / full == pytest.approx((n + 1) / (2 * n), rel=1e-6)


@pytest.mark.parametrize("k,width", [(48, 12), (48, 48), (12, 48)])
def test_block_step_is_the_polynomial_and_member_flops_counts_it(k, width):
    # A narrow block (width < k) takes b (A X) + c A (A X), a wide one forms A A first: the
    # same polynomial, and member_flops counts the matmuls each one runs.
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_muon.split_newton_schulz import block_step, member_flops

    gen = torch.Generator().manual_seed(k + width)
    X = torch.randn(k, width, generator=gen, dtype=torch.float64) / 10
    A = torch.randn(k, k, generator=gen, dtype=torch.float64) / 10
    A = A + A.mT
    a, b, c = 3.4445, -4.7750, 2.0315
    expected = a * X + (b * A + c * A @ A) @ X
    assert torch.allclose(block_step(X, A, a, b, c), expected, rtol=1e-12, atol=1e-12)

    ranks, steps = 4, 3
    with FlopCounterMode(display=False) as counter:
        for _ in range(steps):
            A = X @ X.mT  # the member's Gram matrix (the all-reduce adds no FLOPs)
            X = block_step(X, A, a, b, c)
    assert counter.get_total_flops() == member_flops(k, width * ranks, steps, ranks)
