"""The CUDA backend's mixture in two launches (gpu/cuda/kernels/fused_moe.py, gpu/cuda/moe.py),
in Triton's interpreter on CPU (compiled, on a GPU): the pairs laid out by expert on the device,
and the experts' outputs equal to each pair's own product, gated or gpt-oss's."""

from __future__ import annotations

import pytest
import torch

from core.config import EngineConfig
from gpu.cuda.kernels.fused_moe import BLOCK_M, align, moe_products
from gpu.cuda.moe import MoeStack, forward
from gpu.launch import load
from gpu.tiny_model import build_tiny_model
from tests.test_phi3 import use_cuda_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 4), (7, 2, 5), (40, 4, 8)])
def test_the_pairs_are_laid_out_by_expert_in_whole_blocks(tokens, k, experts):
    g = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if tokens > 1:
        chosen[chosen == 1] = 0  # an expert no token chose
    sorted_ids, blocks = align(chosen.to(DEVICE), experts)
    sorted_ids, blocks = sorted_ids.cpu(), blocks.cpu()
    pairs = tokens * k
    assert sorted_ids.numel() == blocks.numel() * BLOCK_M
    assert sorted_ids.numel() >= pairs + experts * (BLOCK_M - 1)  # the shape's bound
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = chosen.flatten()
    for b, e in enumerate(blocks.tolist()):
        rows = sorted_ids[b * BLOCK_M : (b + 1) * BLOCK_M]
        rows = rows[rows < pairs]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all() and (rows.diff() > 0).all()  # tokens in order
    used = blocks[blocks >= 0]
    assert (used.diff() >= 0).all() and set(used.tolist()) == set(flat.tolist())


def reference(x, w1, b1, w2, b2, weights, chosen, act):
    """Each (token, choice) pair's own products, weighted and summed (float64)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            h = x[t].double() @ w1[e].double().T + (0 if b1 is None else b1[e].double())
            h = act(h)
            y = h @ w2[e].double().T + (0 if b2 is None else b2[e].double())
            out[t] += float(weights[t, j]) * y
    return out


@pytest.mark.parametrize("kind", ["silu", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_the_experts_equal_each_pairs_own_products(kind, tokens):
    from gpu.models.gpt_oss import swiglu

    g = torch.Generator().manual_seed(tokens)
    e, hidden, inter, k = 4, 48, 40, 2  # widths that are not whole tiles
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(e, 2 * inter, hidden, generator=g) / 8
    w2 = torch.randn(e, hidden, inter, generator=g) / 8
    b1 = torch.randn(e, 2 * inter, generator=g) if kind == "gpt_oss" else None
    b2 = torch.randn(e, hidden, generator=g) if kind == "gpt_oss" else None
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    if kind == "gpt_oss":
        limits = (7.0, 1.702)

        def act(h):
            return swiglu(h[None].float(), *limits)[0].double()
    else:
        limits = None

        def act(h):
            gate, up = h.chunk(2)
            return torch.nn.functional.silu(gate) * up

    s = MoeStack(*(t if t is None else t.to(DEVICE) for t in (w1, b1, w2, b2)), "silu", limits)
    got = forward(x.to(DEVICE), weights.to(DEVICE), chosen.to(DEVICE), s).cpu()
    want = reference(x, w1, b1, w2, b2, weights, chosen, act)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused():
    sorted_ids, blocks = align(torch.zeros(2, 1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="contiguous rows"):
        moe_products(torch.randn(2, 5), torch.randn(2, 3, 4), None, sorted_ids, blocks, 1, True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_mixture_on_the_cuda_backend_runs_stacked(arch, tmp_path, monkeypatch):
    """Every mixture layer's experts are stacked (one form: the experts' own weights are views
    of it); quantized experts would keep the per-expert path."""
    path = build_tiny_model(tmp_path / arch, arch, num_layers=2)
    config = use_cuda_backend(monkeypatch)
    core = load(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, **config)).core
    try:
        for layer in core.runner.model.model.layers:
            stacked = layer.mlp.stacked
            assert stacked is not None and stacked.gate_up.shape[0] == len(layer.mlp.experts)
            first = layer.mlp.experts[0]
            weight = first.gate_up[0] if arch == "gpt_oss" else first.gate_up[1][0]
            assert weight.data_ptr() == stacked.gate_up.data_ptr()
    finally:
        core.close()
