"""Triton kernels against the torch reference (on CPU under TRITON_INTERPRET=1): K/V writes by slot
mapping, and paged attention over mixed batches of prefill chunks and decodes."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.backend import AttentionMetadata
from gpu.attention.torch_ref import TorchAttention
from gpu.cuda.attention import TritonAttention
from gpu.cuda.kernels.decode_attention import decode_attention, num_splits_for
from gpu.cuda.kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def make_batch(specs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """specs: (new query tokens, tokens already cached) per sequence. Returns the query, random
    caches, and metadata whose block tables scatter each sequence over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(q + c) // block_size) for q, c in specs) + 3
    perm = torch.randperm(total_blocks, generator=g).tolist()
    tables, slots, query_lens, seq_lens = [], [], [], []
    for q, c in specs:
        n = -(-(q + c) // block_size)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        query_lens.append(q)
        seq_lens.append(q + c)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata.build(
        slots, tables, query_lens, seq_lens, lambda d, dt: torch.tensor(d, dtype=dt, device=device)
    )
    shape = (total_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    query = torch.randn((sum(query_lens), num_heads, head_dim), generator=g).to(device, dtype)
    return query, k_cache, v_cache, meta


def batch_specs(bs):
    return [
        (1, bs - 1),  # decode: context ends exactly on a block boundary
        (1, bs),  # decode: just past it
        (1, 3 * bs + 5),
        (5, 2 * bs - 5),  # prefill chunk ending on a boundary
        (bs + 1, 0),  # a whole prompt, just past a boundary
        (7, bs + 2),  # a later chunk of a long prompt
    ]


CASES = [  # head_dim, query heads, kv heads (GQA 1/4/8), block size, dtype
    (64, 4, 4, 16, torch.float32),
    (64, 8, 2, 32, torch.float16),
    (64, 8, 1, 128, torch.bfloat16),
    (128, 4, 4, 32, torch.bfloat16),
    (128, 8, 2, 16, torch.float32),
    (128, 8, 1, 64, torch.float16),
    (256, 2, 2, 16, torch.float16),
    (256, 8, 2, 16, torch.bfloat16),
    (256, 8, 1, 32, torch.float32),
]


@pytest.mark.parametrize("head_dim,heads,kv_heads,bs,dtype", CASES)
def test_attention_matches_reference(head_dim, heads, kv_heads, bs, dtype):
    query, k_cache, v_cache, meta = make_batch(
        batch_specs(bs), bs, heads, kv_heads, head_dim, dtype
    )
    scale = head_dim**-0.5
    want = TorchAttention().forward(query.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = TritonAttention().forward(query, k_cache, v_cache, meta, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 5, 20])
def test_sliding_window_matches_reference(window):
    query, k_cache, v_cache, meta = make_batch(batch_specs(16), 16, 4, 2, 64, torch.float32)
    want = TorchAttention().forward(query, k_cache, v_cache, meta, 0.125, window)
    got = TritonAttention().forward(query, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 20])
def test_soft_capped_scores_match_the_reference(window):
    # Gemma 2's cap, prefill tiles and decodes (split over the context too), with scores large
    # enough that the cap bends them
    specs = batch_specs(16) + [(1, 300)]
    query, k_cache, v_cache, meta = make_batch(specs, 16, 4, 2, 64, torch.float32, seed=4)
    query = query * 8
    want = TorchAttention().forward(query, k_cache, v_cache, meta, 0.125, window, softcap=2.0)
    got = TritonAttention().forward(query, k_cache, v_cache, meta, 0.125, window, softcap=2.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = TorchAttention().forward(query, k_cache, v_cache, meta, 0.125, window)
    assert (got - plain).abs().max() > 1e-2


def decode(query, k_cache, v_cache, meta, scale, window=0, **kw):
    """The decode kernel alone over a batch's decode rows (the other rows left NaN)."""
    out = torch.full_like(query, float("nan"))
    decode_attention(
        out,
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.decode_seq_ids,
        meta.max_decode_seq_len,
        scale,
        window,
        **kw,
    )
    return out


@pytest.mark.parametrize("splits", [1, 4])
def test_sinks_match_the_reference(splits):
    # gpt-oss's sinks (a logit per head in each softmax's sum): prefill tiles with a window,
    # decodes whole and split over the context (the sink counted once, in the reduce)
    specs = batch_specs(16) + [(1, 300)]
    query, k_cache, v_cache, meta = make_batch(specs, 16, 4, 2, 64, torch.float32, seed=6)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 6.0], device=query.device)
    want = TorchAttention().forward(query * 4, k_cache, v_cache, meta, 0.125, 20, sinks=sinks)
    got = TritonAttention().forward(query * 4, k_cache, v_cache, meta, 0.125, 20, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    decoded = decode(query * 4, k_cache, v_cache, meta, 0.125, 20, sinks=sinks, num_splits=splits)
    rows = torch.tensor(meta.decode_seq_ids_cpu, device=query.device)
    starts = meta.query_start_loc[rows].long()
    torch.testing.assert_close(decoded[starts], want[starts], atol=1e-4, rtol=1e-4)
    plain = TorchAttention().forward(query * 4, k_cache, v_cache, meta, 0.125, 20)
    assert (got - plain).abs().max() > 1e-2  # the sinks changed the result


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_split_kv_decode_matches_reference(splits):
    specs = [(1, 300), (1, 17), (1, 64)]  # some splits of the short ones are empty
    query, k_cache, v_cache, meta = make_batch(specs, 16, 8, 2, 64, torch.float32, seed=3)
    want = TorchAttention().forward(query, k_cache, v_cache, meta, 0.125)
    got = decode(query, k_cache, v_cache, meta, 0.125, num_splits=splits)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cache_under_a_float32_query(cache_dtype):
    """--kv-cache-dtype: K/V stored rounded to 16 bits and widened as the kernels read them."""
    query, k_cache, v_cache, meta = make_batch(
        batch_specs(16) + [(1, 300)], 16, 8, 2, 64, torch.float32, seed=4
    )
    k16, v16 = (
        torch.zeros_like(k_cache, dtype=cache_dtype),
        torch.zeros_like(v_cache, dtype=cache_dtype),
    )
    flat = k_cache.view(-1, 2, 64)
    slots = torch.arange(flat.shape[0], device=DEVICE)
    TritonAttention().write_kv(flat, v_cache.view(-1, 2, 64), k16, v16, slots)
    if DEVICE == "cuda" or cache_dtype == torch.float16:  # rounded as torch rounds
        assert torch.equal(k16, k_cache.to(cache_dtype))
        assert torch.equal(v16, v_cache.to(cache_dtype))
    else:  # Triton's interpreter truncates float32 to bfloat16: within one unit of the last bit
        torch.testing.assert_close(k16.float(), k_cache, atol=0, rtol=2**-7)
        torch.testing.assert_close(v16.float(), v_cache, atol=0, rtol=2**-7)
    got = TritonAttention().forward(query, k16, v16, meta, 0.125)
    assert got.dtype == torch.float32
    want = TorchAttention().forward(query, k16.float(), v16.float(), meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_split_count_is_chosen_for_small_batches_and_long_contexts():
    assert num_splits_for(1, 8, 16384, 132, 64) > 1  # one long sequence: split it
    assert num_splits_for(256, 8, 16384, 132, 64) == 1  # plenty of programs already
    assert num_splits_for(1, 8, 100, 132, 64) == 1  # too short to be worth it
    # the H200's sweep: one tile a split at batch 1 x 1k, 4 splits at batch 32, never above 32
    assert num_splits_for(1, 8, 1024, 132, 64) == 16
    assert num_splits_for(32, 8, 4096, 132, 64) == 4
    assert num_splits_for(1, 8, 1 << 20, 132, 64) == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(0)
    key = torch.randn((6, 2, 64), generator=g).to(DEVICE, dtype)
    value = torch.randn((6, 2, 64), generator=g).to(DEVICE, dtype)
    slots = torch.tensor([0, 17, -1, 5, 31, -1], device=DEVICE)
    caches = [torch.zeros((2, 16, 2, 64), device=DEVICE, dtype=dtype) for _ in range(4)]
    TorchAttention().write_kv(key, value, caches[0], caches[1], slots)
    store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[2].flatten(0, 1).abs().sum(dim=(1, 2)) > 0).sum()) == 4


def test_wrappers_reject_bad_inputs():
    query, k_cache, v_cache, meta = make_batch([(1, 5)], 16, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(
            torch.empty(1, 3, 64),
            torch.empty(1, 3, 64),
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.decode_seq_ids,
            6,
            0.1,
        )
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(
            query,
            query.half(),
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.decode_seq_ids,
            6,
            0.1,
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(query[:, :2], query[:, :2], k_cache, v_cache, torch.zeros(5, dtype=torch.int64))


def test_kernels_compile_for_the_h200_without_a_gpu(tmp_path):
    """The interpreter checks what the kernels compute; this checks they compile to sm_90 cubins
    (types, control flow, tensor-core shapes) with the ptxas in the triton wheel."""
    import os
    import subprocess
    import sys

    from gpu.cuda.kernels.aot import CASES

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    proc = subprocess.run(
        [sys.executable, "-m", "gpu.cuda.kernels.aot", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sm_90")]
    assert len(lines) == len(CASES) and all(
        "cubin" in line and not line.endswith(" 0 bytes") for line in lines
    )
