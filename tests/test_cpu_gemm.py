"""weir's CPU matrix-product kernel (gpu/cpu/gemm.py, gpu/cpu/csrc/gemm.cpp) against torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu.cpu.gemm import GemmGatedMLP, GemmLinear, use_gemm
from gpu.models.decoder import _ACTIVATIONS


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
        torch.testing.assert_close(
            layer.forward_binary(x, residual, "add"), want + residual, atol=1e-4, rtol=1e-4
        )


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
    with pytest.raises(ValueError, match="post-op"):
        layer.forward_binary(x, x, "mul")


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
        got = layer.forward_binary(x, residual, "add")
        torch.testing.assert_close(got, want + residual, atol=1e-4, rtol=1e-4)
        assert torch.equal(layer(x)[4500:4501], layer(x[4500:4501]))


@pytest.mark.parametrize("act", list(_ACTIVATIONS))
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_gated_mlp_matches_torch(act, rows):
    torch.manual_seed(rows)
    gate, up = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
    down = nn.Linear(96, 64, bias=False)
    mlp = GemmGatedMLP(gate, up, down, act)
    # large inputs: the activation sees values far past exp's float range
    x, residual = torch.randn(rows, 64) * 20, torch.randn(rows, 64)
    with torch.no_grad():
        want = down(_ACTIVATIONS[act](gate(x)) * up(x))
        got = mlp(x)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(mlp(x, residual), want + residual, atol=1e-3, rtol=1e-4)


class Gated(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(32, 48, bias=bias), nn.Linear(32, 48, bias=bias)
        self.down_proj = nn.Linear(48, 32, bias=bias)
        self.hidden_act = "silu"

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_use_gemm_replaces_linears_and_gated_mlps():
    """A bias-free gated MLP becomes one GemmGatedMLP; one with biases keeps its three products
    (each a GemmLinear) and torch's activation; any other Linear becomes a GemmLinear."""
    torch.manual_seed(1)
    holder = nn.Module()
    holder.mlp, holder.biased, holder.head = Gated(False), Gated(True), nn.Linear(32, 50)
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = [holder.mlp(x), holder.biased(x), holder.head(x)]
        assert use_gemm(holder) == 7
        assert isinstance(holder.mlp, GemmGatedMLP) and isinstance(holder.head, GemmLinear)
        assert isinstance(holder.biased.gate_proj, GemmLinear)
        got = [holder.mlp(x), holder.biased(x), holder.head(x)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
