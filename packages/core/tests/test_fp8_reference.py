"""kvik.quantization.fp8_reference, the FP8 numerics every kernel is held to, against float64
emulations written from the contract (docs/architecture.md, "Quantization")."""

from __future__ import annotations

import pytest
import torch

from kvik.quantization.fp8_reference import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    fp8_block_linear,
    fp8_scaled_linear,
    quantize_fp8,
    quantize_per_token,
    quantize_per_token_group,
)


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, ascending."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).double()
    return every[every.isfinite()].unique()


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3 grid by search (clamped to ±448), in float64."""
    grid = e4m3_values()
    x = x.double().clamp(-FP8_MAX, FP8_MAX)
    hi = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    d_lo, d_hi = x - lo_v, hi_v - x
    # ties to the value whose last mantissa bit is 0
    hi_bits = hi_v.to(FP8_DTYPE).view(torch.uint8) & 1
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi_bits == 0))
    return torch.where(pick_hi, hi_v, lo_v)


def test_quantize_rounds_to_nearest_even_and_saturates():
    grid = e4m3_values()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties
    x = torch.cat([grid, mids, mids + 1e-9, mids - 1e-9, torch.tensor([500.0, -1e6, 449.0])])
    got = quantize_fp8(x.float(), torch.tensor(1.0)).double()
    want = round_to_e4m3(x.float().double())
    assert torch.equal(got, want)
    assert got.abs().max() == FP8_MAX  # clamped, never NaN


def test_dynamic_scales_map_the_largest_magnitude_to_448_and_zero_rows_stay_finite():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    q, s = quantize_per_token(x)
    assert s[0, 0] == MIN_SCALE and torch.equal(q[0].float(), torch.zeros(3))
    assert s[1, 0] == pytest.approx(2.0 / FP8_MAX) and q[1, 1].float() == -FP8_MAX


def test_token_groups_cover_a_short_last_group():
    torch.manual_seed(0)
    x = torch.randn(3, 2 * BLOCK + 5)
    x[1, BLOCK:] = 0  # an all-zero group
    q, s = quantize_per_token_group(x)
    assert s.shape == (3, 3) and q.shape == x.shape
    for g, (lo, hi) in enumerate([(0, BLOCK), (BLOCK, 2 * BLOCK), (2 * BLOCK, 2 * BLOCK + 5)]):
        want_s = (x[:, lo:hi].abs().amax(1) / FP8_MAX).clamp(min=MIN_SCALE)
        assert torch.equal(s[:, g], want_s)
        assert torch.equal(q[:, lo:hi], quantize_fp8(x[:, lo:hi], want_s[:, None]))
    assert torch.isfinite(q.float()).all()


def emulate_block(x, weight, scale, bias):
    """float64: per-group products scaled and summed, the contract's formula."""
    n, k = weight.shape
    groups = -(-k // BLOCK)
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g in range(groups):
        cols = slice(g * BLOCK, min(k, (g + 1) * BLOCK))
        xg = x[:, cols].double()
        sa = (xg.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        qa = round_to_e4m3((xg / sa).float().double())
        sw = scale[:, g].double().repeat_interleave(BLOCK)[:n]
        y += (qa @ weight[:, cols].double().T) * sa * sw[None, :]
    return y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_matches_the_per_group_formula(dtype):
    torch.manual_seed(1)
    n, k = 2 * BLOCK + 32, BLOCK + 40  # partial tiles both ways
    weight = (torch.randn(n, k) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = torch.rand(-(-n // BLOCK), -(-k // BLOCK)) / 100 + 1e-3
    bias = torch.randn(n)
    x = torch.randn(2, 3, k).to(dtype)
    got = fp8_block_linear(x, weight, scale, bias)
    assert got.shape == (2, 3, n) and got.dtype == dtype
    want = emulate_block(x.reshape(6, k).float(), weight.float(), scale, bias)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.reshape(6, n).double(), want, rtol=tol, atol=tol * 10)


def test_block_linear_refuses_scales_of_the_wrong_tiling():
    weight = torch.zeros(384, 200, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match=r"do not tile a \[384, 200\] weight"):
        fp8_block_linear(torch.zeros(1, 200), weight, torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"expected \(3, 2\)"):  # transposed scales
        fp8_block_linear(torch.zeros(1, 200), weight, torch.ones(3, 2).T)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_linear_matches_the_formula(per_channel, static):
    torch.manual_seed(2)
    n, k = 48, 80
    weight = (torch.randn(n, k) * 80).to(FP8_DTYPE)
    w_scale = torch.rand(n) / 50 + 1e-3 if per_channel else torch.tensor([0.01])
    x = torch.randn(5, k)
    input_scale = torch.tensor([0.004]) if static else None
    got = fp8_scaled_linear(x, weight, w_scale, input_scale, None)
    xd = x.double()
    if static:
        sa = torch.full((5, 1), 0.004, dtype=torch.float64)
    else:
        sa = (xd.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    qa = round_to_e4m3((xd / sa).float().double())
    want = (qa @ weight.double().T) * sa * w_scale.double().reshape(1, -1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
