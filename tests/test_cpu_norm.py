"""The compiled RMSNorm + rotary kernel and Cohere's layer norm (gpu/cpu/norm.py) against the
torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from gpu.backend import TorchBackend
from gpu.cpu import norm as cpu_norm
from gpu.models.rope import apply_rope

TORCH = TorchBackend(None, fuse=False)  # the torch ops the kernel replaces


@pytest.fixture(scope="module")
def ops():
    return cpu_norm


def rope_tables(tokens: int, dim: int):
    positions = torch.randint(0, 4096, (tokens,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("tokens", [0, 1, 5, 600])
@pytest.mark.parametrize("dim", [64, 96, 768])
def test_rms_norm_matches_torch(ops, tokens, dim):
    torch.manual_seed(dim + tokens)
    weight = torch.randn(dim)
    x = torch.randn(tokens, dim) * 3
    want = TORCH.rms_norm(x, weight, 1e-6)
    got = ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [0, 1, 5, 600])
@pytest.mark.parametrize("dim", [64, 96, 768])
def test_layer_norm_matches_torch_on_strided_rows(ops, tokens, dim):
    """Rows of a wider tensor, off-centre (a mean of 5 to take away); the input untouched."""
    torch.manual_seed(dim + tokens)
    weight = torch.randn(dim)
    wide = torch.randn(tokens, dim + 7) * 3 + 5
    x = wide[:, :dim]
    for bias in (None, torch.randn(dim)):  # (Cohere's: none; Nemotron's)
        want = TORCH.layer_norm(x, weight, 1e-5, bias)
        got = ops.layer_norm(x, weight, 1e-5, bias)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(x, wide[:, :dim])


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 4, 64), (37, 12, 64), (300, 2, 128), (3, 1, 32)])
def test_norm_rope_matches_torch_on_strided_views(ops, with_norm, tokens, heads, dim):
    """Q as a view of a wider fused QKV output (token stride wider than heads x dim)."""
    torch.manual_seed(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2) * dim) * 2
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin = rope_tables(tokens, dim)
    weight = torch.randn(dim)
    want = apply_rope(TORCH.rms_norm(q, weight, 1e-6) if with_norm else q, cos, sin)
    got = ops.norm_rope(q, weight if with_norm else None, 1e-6, cos, sin)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(q, qkv[:, : heads * dim].view(tokens, heads, dim))  # input untouched


def test_rejects_what_it_cannot_run(ops):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        ops.rms_norm(x.double(), torch.ones(64, dtype=torch.double), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(torch.randn(64, 4).t(), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        ops.layer_norm(torch.randn(64, 4).t(), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops.layer_norm(x, torch.ones(63), 1e-6)
    cos, sin = rope_tables(4, 64)
    with pytest.raises(ValueError, match="cos/sin"):
        ops.norm_rope(x.view(4, 1, 64), None, 0.0, cos.t().contiguous().t(), sin)


def test_where_the_kernels_cannot_build_a_float32_model_runs_on_onednn_and_torch(monkeypatch):
    """The backend choice, once: no compiler, so oneDNN's products and torch's norms (a warning
    says so); --cpu-forward fused refuses to start instead."""
    from core.config import EngineConfig
    from gpu import assemble
    from gpu.cpu import build as cpu_build
    from gpu.cpu.backend import CpuBackend, OneDnnBackend

    def fail():
        raise cpu_build.BuildError("no compiler")

    monkeypatch.setattr(cpu_build, "load", fail)
    cpu = torch.device("cpu")
    config = EngineConfig(attention_backend="torch")
    backend = assemble.choose_backend(config, cpu, torch.float32)
    assert type(backend) is OneDnnBackend and not isinstance(backend, CpuBackend)
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(backend.rms_norm(x, w, 1e-6), TORCH.rms_norm(x, w, 1e-6))
    with pytest.raises(ValueError, match="cannot be built"):
        assemble.choose_backend(EngineConfig(cpu_forward="fused"), cpu, torch.float32)


@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_are_bitwise_the_per_step_arithmetic(head_dim, dtype):
    from types import SimpleNamespace

    from gpu.models.rope import Rope

    rope = Rope(SimpleNamespace(rope_theta=500000.0), head_dim, torch.device("cpu"))
    for positions in (
        torch.tensor([5]),
        torch.arange(700),
        torch.randint(0, 5000, (64,)),
        torch.tensor([4095, 4096, 9000]),  # the table grows past its first size
    ):
        got, want = rope.cos_sin(positions, dtype), rope._compute(positions, dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
