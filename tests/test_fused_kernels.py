"""The CUDA backend's fused kernels (gpu/cuda/kernels/rms_norm.py, gated_act.py, rope_store.py)
against the torch ops they replace (gpu/backend.py TorchBackend), on CPU under TRITON_INTERPRET=1
or compiled on a GPU: odd sizes, every dtype, padding slots, a 16-bit cache under float32.

What "equal" means, per kernel (their docstrings say why):
- the residual sum, the values stored and a rotation without Q/K norm: bit for bit (except
  where the interpreter's truncation to bfloat16 stands in for a GPU's rounding);
- anything after a norm or an activation: within two roundings of a 16-bit dtype, most elements
  bit for bit; float32 within a few units in the last place.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu.attention.torch_ref import TorchAttention
from gpu.backend import TorchBackend
from gpu.cuda.backend import CudaBackend
from gpu.cuda.kernels.gated_act import gated_act
from gpu.cuda.kernels.rms_norm import add_rms_norm, rms_norm
from gpu.cuda.kernels.rope_store import rope_store
from gpu.models.rope import Rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REF = TorchBackend(TorchAttention(), fuse=True)
FUSED = CudaBackend(TorchAttention())


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def rounds_as_torch(dtype: torch.dtype) -> bool:
    """Whether the kernels' casts to `dtype` round as torch's do here: always on a GPU; Triton's
    interpreter rounds float32 to float16 to nearest, but truncates to bfloat16."""
    return dtype != torch.bfloat16 or DEVICE == "cuda"


def assert_rounding_close(got, want, min_exact=0.9):
    """Within two roundings of a 16-bit dtype (relative to the larger values; four where the
    interpreter truncates) and mostly bit for bit; float32 within eight units in the last place
    (its sums, rsqrt, exp and division are not torch's)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        ulps = 8
    else:
        ulps = 2 if rounds_as_torch(want.dtype) else 4
    eps = torch.finfo(want.dtype).eps * ulps
    scale = want.float().abs().amax().item() or 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps * scale)
    if want.dtype != torch.float32 and rounds_as_torch(want.dtype):
        exact = (got == want).float().mean().item()
        assert exact >= min_exact, f"only {exact:.3f} of the elements are bit for bit"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 100), (3, 1030)])
def test_rms_norm_and_residual_add_match_torch(dtype, rows, hidden):
    x = randn(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    residual = randn(rows, hidden, dtype=dtype, seed=2)
    weight = randn(hidden, dtype=dtype, seed=3)
    eps = 1e-6
    assert_rounding_close(rms_norm(x, weight, eps), REF.rms_norm(x, weight, eps))

    out, h = add_rms_norm(x, residual, weight, eps)
    if rounds_as_torch(dtype):
        assert torch.equal(h, residual + x)  # the residual stream: exact
    else:
        assert_rounding_close(h, residual + x)
    assert_rounding_close(out, REF.rms_norm(residual + x, weight, eps))

    # the backend's composite step: the product, then the fused add and norm
    w = (randn(hidden, 48, dtype=dtype, seed=4), None)
    y = randn(rows, 48, dtype=dtype, seed=5)
    got, got_h = FUSED.linear_norm(y, w, residual, weight, eps)
    want, want_h = REF.linear_norm(y, w, residual, weight, eps)
    assert torch.equal(got_h, want_h) or not rounds_as_torch(dtype)
    assert_rounding_close(got, want)


def test_rms_norm_takes_any_leading_shape_and_a_strided_input():
    x = randn(4, 7, 3, 32, seed=6)[:, 1:5]  # [4, 4, 3, 32], not contiguous
    weight = randn(32, seed=7)
    assert_rounding_close(rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5))
    # a float32 weight over 16-bit rows: torch's promotion, float32 out
    xh = x.to(torch.float16)
    got = rms_norm(xh, weight, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, REF.rms_norm(xh, weight, 1e-5), rtol=2e-3, atol=2e-3)
    assert rms_norm(x[:0], weight, 1e-5).shape == (0, 4, 3, 32)


# e^-x overflows to inf for very negative x (the activation is then -0, as torch's): numpy warns
INTERPRETED_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


@INTERPRETED_OVERFLOW
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_gated_activation_matches_torch(act, dtype):
    # 1030 columns: two blocks of the kernel, the second ragged; a bias on the product
    x = randn(3, 40, dtype=dtype, seed=8)
    weights = (
        randn(2 * 1030, 40, dtype=dtype, seed=9, scale=0.5),
        randn(2 * 1030, dtype=dtype, seed=10),
    )
    w = ("fused", weights, act)
    # The tanh form is computed as x / (1 + e^-2z), torch's CUDA kernel as tanhf: on an H200
    # 89.6% of the bfloat16 results were bit for bit (all within two roundings).
    min_exact = 0.85 if act == "gelu_pytorch_tanh" else 0.9
    assert_rounding_close(FUSED.gated(x, w), REF.gated(x, w), min_exact=min_exact)


@INTERPRETED_OVERFLOW
def test_gated_activation_reads_strided_rows_and_extremes():
    y = randn(4, 2 * 9 + 5, seed=11, scale=40.0)[:, : 2 * 9]  # row stride 23
    y[0, 0], y[0, 1], y[0, 2] = 100.0, -100.0, 0.0
    g, u = y.chunk(2, dim=-1)
    for act in ("silu", "gelu", "gelu_pytorch_tanh"):
        want = {
            "silu": torch.nn.functional.silu(g),
            "gelu": torch.nn.functional.gelu(g),
            "gelu_pytorch_tanh": torch.nn.functional.gelu(g, approximate="tanh"),
        }[act] * u
        got = gated_act(y, act)
        assert torch.isfinite(got).all()
        assert_rounding_close(got, want, min_exact=0.5)


def rope_case(t, heads, kv_heads, d, dtype, cache_dtype, bs=4, seed=0):
    """q, k, v as views of one Q/K/V product's output, cos/sin of scattered positions, random
    caches, and slots over shuffled blocks with padding rows (-1)."""
    qkv = randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    rope = Rope(SimpleNamespace(rope_theta=10000.0), d, torch.device(DEVICE))
    positions = torch.tensor([(i * 37) % 1000 for i in range(t)], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    blocks = -(-t // bs) + 2
    shape = (blocks, bs, kv_heads, d)
    k_cache, v_cache = randn(*shape, dtype=cache_dtype, seed=seed + 1), randn(*shape, seed=seed + 2)
    v_cache = v_cache.to(cache_dtype)
    perm = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(seed)).tolist()
    slots = torch.tensor(
        [-1 if i % 3 == 2 else perm[i] for i in range(t)], dtype=torch.int64, device=DEVICE
    )
    return q, k, v, cos, sin, k_cache, v_cache, slots


ROPE_CASES = [  # tokens, heads, kv heads, head_dim, dtype, cache dtype
    (7, 4, 2, 64, torch.float32, torch.float32),
    (5, 2, 2, 48, torch.float16, torch.float16),
    (6, 3, 1, 128, torch.bfloat16, torch.bfloat16),
    (4, 4, 4, 24, torch.bfloat16, torch.bfloat16),
    (5, 4, 1, 64, torch.float32, torch.bfloat16),  # --kv-cache-dtype under a float32 model
    (5, 2, 1, 32, torch.float32, torch.float16),
    (3, 10, 9, 256, torch.float16, torch.float16),  # 8 rows a program, across tokens
]


@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("t,heads,kv,d,dtype,cache_dtype", ROPE_CASES)
def test_rope_store_matches_torch_and_skips_padding(t, heads, kv, d, dtype, cache_dtype, norm):
    case = rope_case(t, heads, kv, d, dtype, cache_dtype)
    q, k, v, cos, sin, k_cache, v_cache, slots = case
    qw = randn(d, dtype=dtype, seed=20) if norm else None
    kw = randn(d, dtype=dtype, seed=21) if norm else None
    eps = 1e-6
    want_kv = (k_cache.clone(), v_cache.clone())
    want = REF.rope_store_kv(q, k, v, qw, kw, eps, cos, sin, want_kv, slots)
    got_kv = (k_cache.clone(), v_cache.clone())
    got = FUSED.rope_store_kv(q, k, v, qw, kw, eps, cos, sin, got_kv, slots)
    assert got.is_contiguous() and got.shape == (t, heads, d)
    # V is copied (and padding rows leave every cache row as it was): exact
    if rounds_as_torch(cache_dtype):
        assert torch.equal(got_kv[1], want_kv[1])
    else:
        assert_rounding_close(got_kv[1], want_kv[1])
    assert not torch.equal(got_kv[1], v_cache)  # something was written
    exact = not norm and rounds_as_torch(dtype) and rounds_as_torch(cache_dtype)
    if exact:
        assert torch.equal(got, want) and torch.equal(got_kv[0], want_kv[0])
    else:
        assert_rounding_close(got, want)
        assert_rounding_close(got_kv[0], want_kv[0])
    padded = slots < 0
    assert padded.any()


def test_rope_store_writes_int32_slots_and_nothing_for_all_padding():
    case = rope_case(3, 2, 1, 16, torch.float32, torch.float32)
    q, k, v, cos, sin, k_cache, v_cache, slots = case
    kc, vc = k_cache.clone(), v_cache.clone()
    rope_store(q, k, v, cos, sin, kc, vc, torch.full((3,), -1, device=DEVICE))
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    rope_store(q, k, v, cos, sin, kc, vc, slots.int())
    want = (k_cache.clone(), v_cache.clone())
    REF.rope_store_kv(q, k, v, None, None, 0.0, cos, sin, want, slots)
    assert torch.equal(vc, want[1])
    empty = rope_store(q[:0], k[:0], v[:0], cos[:0], sin[:0], kc, vc, slots[:0])
    assert empty.shape == (0, 2, 16)


def test_wrappers_reject_bad_inputs():
    x, w = randn(3, 8), randn(8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(8, 1), 1e-6)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        rms_norm(randn(3, 9), w, 1e-6)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        rms_norm(x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, x.half(), w, 1e-6)
    with pytest.raises(ValueError, match="activation"):
        gated_act(randn(2, 8), "relu")
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        gated_act(randn(2, 7), "silu")
    with pytest.raises(ValueError, match="contiguous"):
        gated_act(randn(8, 2).t(), "silu")
    q, k, v, cos, sin, kc, vc, slots = rope_case(3, 2, 1, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="even"):
        rope_store(q[..., :15], k[..., :15], v[..., :15], cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="cos"):
        rope_store(q, k, v, cos.half(), sin, kc, vc, slots)
    with pytest.raises(ValueError, match="v"):
        rope_store(q, k, v.half(), cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="together"):
        rope_store(q, k, v, cos, sin, kc, vc, slots, q_weight=randn(16))
    with pytest.raises(ValueError, match="cache heads"):
        rope_store(q, k, v, cos, sin, kc[:, :, :0], vc[:, :, :0], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_store(q, k, v, cos, sin, kc, vc, slots.float())
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_store(q, k, v, cos, sin, kc, vc, slots[:2])
