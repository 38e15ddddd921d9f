"""weir's CPU matrix-product kernel (gpu/cpu/gemm.py, gpu/cpu/csrc/gemm.cpp) against torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu.backend import ACTIVATIONS as _ACTIVATIONS
from gpu.cpu import gemm


class GemmLinear:
    """An nn.Linear's weight on the kernel, called as the layer was."""

    def __init__(self, linear: nn.Linear) -> None:
        self.w = gemm.prepare(linear.weight, linear.bias)

    def __call__(self, x, residual=None):
        return gemm.linear(x, self.w, residual)


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


# rows: 1 (decode), micro-tile tails, more than one row block, four or more (block-major, a
# partial last block); shapes: partial panels, K past one L1 chunk and not a multiple of it,
# tiny K
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 13, 64, 130, 400])
@pytest.mark.parametrize("n,k", [(768, 512), (100, 37), (70, 300), (16, 1)])
def test_linear_matches_torch(rows, n, k):
    torch.manual_seed(rows * 1000 + n + k)
    linear = nn.Linear(k, n, bias=True)
    layer = GemmLinear(linear)
    x, residual = torch.randn(rows, k), torch.randn(rows, n)
    with torch.no_grad():
        want = exact(x, linear.weight) + linear.bias
        got = layer(x)
        assert got.shape == (rows, n)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer(x, residual), want + residual, atol=1e-4, rtol=1e-4)


def test_leading_dims_and_strided_rows():
    """[b, t, k] inputs keep their leading dims; a row view of a wider tensor is read in place."""
    torch.manual_seed(3)
    linear = nn.Linear(40, 24, bias=False)
    layer = GemmLinear(linear)
    wide = torch.randn(9, 100)
    x = wide[:, 10:50]  # rows 100 floats apart
    with torch.no_grad():
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
        x3 = torch.randn(2, 3, 40)
        torch.testing.assert_close(layer(x3), linear(x3), atol=1e-5, rtol=1e-5)


def test_a_row_does_not_depend_on_its_batch():
    """Each output is one sum over k in order: a row's result is bitwise the same alone, in a
    batch of 7, of 200 or of 700 (taken block-major), on any thread count (what keeps a
    request's logits independent of what it is batched with)."""
    torch.manual_seed(0)
    layer = GemmLinear(nn.Linear(512, 300, bias=False))
    x = torch.randn(700, 512)
    with torch.no_grad():
        alone = layer(x[5:6])
        threads = torch.get_num_threads()
        try:
            for t in {1, max(2, threads)}:
                torch.set_num_threads(t)
                assert torch.equal(layer(x[:7])[5:6], alone)
                assert torch.equal(layer(x[:200])[5:6], alone)
                assert torch.equal(layer(x)[5:6], alone)
                assert torch.equal(layer(x)[650:651], layer(x[650:651]))
        finally:
            torch.set_num_threads(threads)


def test_a_product_past_the_packing_bound_runs_in_row_passes():
    """More of x than the kernel packs at once (4M floats: here 5,000 x 1,000) runs as passes
    over row ranges: the same result, a row's value the same as alone."""
    torch.manual_seed(1)
    linear = nn.Linear(1000, 70, bias=True)
    layer = GemmLinear(linear)
    x, residual = torch.randn(5000, 1000), torch.randn(5000, 70)
    with torch.no_grad():
        want = exact(x, linear.weight) + linear.bias
        got = layer(x, residual)
        torch.testing.assert_close(got, want + residual, atol=1e-4, rtol=1e-4)
        assert torch.equal(layer(x)[4500:4501], layer(x[4500:4501]))


@pytest.mark.parametrize("act", list(_ACTIVATIONS))
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_gated_mlp_matches_torch(act, rows):
    torch.manual_seed(rows)
    gate, up = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
    down = nn.Linear(96, 64, bias=False)
    pair, packed_down = gemm.prepare_gated(gate.weight, up.weight, act), GemmLinear(down)

    def mlp(x, residual=None):
        return packed_down(gemm.gated(x, pair), residual)

    # large inputs: the activation sees values far past exp's float range
    x, residual = torch.randn(rows, 64) * 20, torch.randn(rows, 64)
    with torch.no_grad():
        want = down(_ACTIVATIONS[act](gate(x)) * up(x))
        got = mlp(x)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(mlp(x, residual), want + residual, atol=1e-3, rtol=1e-4)


def test_the_backend_packs_a_bias_free_gated_mlp_and_keeps_biased_ones_apart():
    """CpuBackend: a bias-free gated MLP becomes one gated product; one with biases keeps its
    gate and up products apart (each packed) and torch's activation."""
    from gpu.attention.select import get_backend
    from gpu.cpu.backend import CpuBackend

    backend = CpuBackend(get_backend("auto", torch.device("cpu")))
    torch.manual_seed(1)
    x = torch.randn(3, 32)
    for bias in (False, True):
        g, u, d = nn.Linear(32, 48, bias=bias), nn.Linear(32, 48, bias=bias), nn.Linear(48, 32)
        parts = [(m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in (g, u)]
        gated, down = backend.prepare_mlp(*parts, (d.weight.detach(), None), "silu")
        assert isinstance(gated, gemm.GemmGated) != bias and isinstance(down, gemm.GemmWeight)
        with torch.no_grad():
            want = torch.nn.functional.silu(g(x)) * u(x)
            torch.testing.assert_close(backend.gated(x, gated), want, atol=1e-5, rtol=1e-5)
