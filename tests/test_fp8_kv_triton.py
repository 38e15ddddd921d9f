"""FP8 KV caches in the Triton kernels (gpu/cuda/kernels/fp8_cache.py): the stores round as
torch's `.to()` does (E4M3 saturated to +-448 first, as the CPU path writes it), bit for bit,
and the attention kernels read the cache widened. Triton's interpreter on CPU (its own FP8
rounding is wrong, so the kernels round in float32 there first); compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.torch_ref import TorchAttention
from gpu.cuda.attention import TritonAttention
from gpu.cuda.kernels.rope_store import rope_store
from gpu.cuda.kernels.store_kv import store_kv
from tests.test_kernels import DEVICE, TOL, batch_specs, decode, make_batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def as_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the CPU path writes: torch's rounding, E4M3 saturated first."""
    return (x.float().clamp(-448, 448) if dtype == torch.float8_e4m3fn else x).to(dtype)


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_the_store_rounds_as_torch_does(cache_dtype):
    """Every kind of value: float32 bit patterns of every exponent (NaN left out), the
    subnormal range, ties, and past the largest finite (E4M3 saturates, E5M2 goes infinite);
    from float32 rows and from bfloat16 ones."""
    g = torch.Generator().manual_seed(1)
    tokens, heads, d = 16, 8, 128  # one program a token in the interpreter: few, wide ones
    bits = torch.randint(-(2**31), 2**31 - 1, (tokens * heads * d,), generator=g)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.where(x.isnan(), torch.zeros_like(x), x)
    x[:4096] = torch.randn(4096, generator=g) * 4.0
    x[4096:4160] = torch.tensor([2.0**-6, 2.0**-9 * 1.5, 2.0**-16 * 2.5, 448.0, 464.0, 57344.0,
                                 61440.0, 1.999, -0.494, -0.0] * 6 + [0.0] * 4)  # fmt: skip
    slots = torch.randperm(4 * 16, generator=g)[:tokens].to(DEVICE)
    slots[3] = -1  # padding: nothing written
    for dtype in (torch.float32, torch.bfloat16):
        key = x.view(tokens, heads, d).to(DEVICE, dtype)
        value = (-x).view(tokens, heads, d).to(DEVICE, dtype)
        caches = [torch.zeros((4, 16, heads, d), dtype=cache_dtype, device=DEVICE) for _ in "kvKV"]
        store_kv(key, value, caches[0], caches[1], slots)
        TorchAttention().write_kv(key, value, caches[2], caches[3], slots)
        assert torch.equal(codes(caches[0]), codes(caches[2]))
        assert torch.equal(codes(caches[1]), codes(caches[3]))
        written = caches[0].view(-1, heads, d)[slots[4:]]
        assert torch.equal(codes(written), codes(as_cache(key[4:], cache_dtype)))


@pytest.mark.parametrize("cache_dtype", FP8)
def test_the_fused_rotation_writes_fp8_as_it_writes_16_bits_then_rounds(cache_dtype):
    """rope_store into an FP8 cache: the keys it rotates and the values, rounded once."""
    g = torch.Generator().manual_seed(2)
    t, h, kv, d = 9, 4, 2, 64
    q, k, v = (torch.randn((t, n, d), generator=g) * 30 for n in (h, kv, kv))
    angles = torch.randn((t, d // 2), generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    slots = torch.tensor([0, 5, 17, -1, 31, 2, 40, 63, 9])
    args = [x.to(DEVICE) for x in (q, k, v, cos, sin)]
    wide = [torch.zeros((4, 16, kv, d), device=DEVICE) for _ in range(2)]
    narrow = [torch.zeros((4, 16, kv, d), dtype=cache_dtype, device=DEVICE) for _ in range(2)]
    want_q = rope_store(*args, *wide, slots.to(DEVICE))
    got_q = rope_store(*args, *narrow, slots.to(DEVICE))
    assert torch.equal(got_q, want_q)
    for got, want in zip(narrow, wide):
        assert torch.equal(codes(got), codes(as_cache(want, cache_dtype)))


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_an_fp8_cache_widened(cache_dtype, dtype):
    """Prefill chunks and decode rows (the batch's own split count, and 4 splits) over FP8 K/V:
    the reference attention over the same cache widened to the query's dtype."""
    query, k_cache, v_cache, meta = make_batch(
        batch_specs(16) + [(1, 300)], 16, 8, 2, 64, dtype, seed=5
    )
    k8, v8 = as_cache(k_cache * 8, cache_dtype), as_cache(v_cache * 8, cache_dtype)
    want = TorchAttention().forward(query, k8.to(dtype), v8.to(dtype), meta, 0.125)
    tol = dict(atol=TOL[dtype] * want.abs().max().item(), rtol=TOL[dtype])
    got = TritonAttention().forward(query, k8, v8, meta, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    rows = torch.tensor(meta.decode_seq_ids_cpu, device=query.device)
    starts = meta.query_start_loc[rows].long()
    decoded = decode(query, k8, v8, meta, 0.125, num_splits=4)
    torch.testing.assert_close(decoded[starts], want[starts], **tol)
