"""The compiled CPU attention kernel against the torch reference: mixed batches of prefill chunks
and decodes over shuffled blocks, every head size / GQA ratio / block size / dtype the Triton
kernels are checked on, sliding windows, long contexts, and the build that produces it."""

from __future__ import annotations

import pytest
import torch

from gpu.cache import cache_dir
from gpu.attention.backend import AttentionMetadata
from gpu.attention.select import get_backend
from gpu.cpu.attention import CpuAttention
from gpu.attention.torch_ref import TorchAttention
from gpu.cpu import build as cpu_build
from tests.test_kernels import CASES, TOL, batch_specs, make_batch


def reference(query, k_cache, v_cache, meta, scale, window=0):
    return TorchAttention().forward(
        query.float(), k_cache.float(), v_cache.float(), meta, scale, window
    )


@pytest.mark.parametrize(
    "head_dim,heads,kv_heads,bs,dtype",
    CASES
    + [
        (80, 6, 3, 16, torch.float32),  # a head size with no compiled specialization
        (32, 4, 2, 16, torch.float32),  # the benchmark models' head size
        (32, 4, 1, 16, torch.bfloat16),
    ],
)
def test_matches_reference(head_dim, heads, kv_heads, bs, dtype):
    # head size 80 takes the kernel's generic (not compile-time) head-size path
    query, k_cache, v_cache, meta = make_batch(
        batch_specs(bs), bs, heads, kv_heads, head_dim, dtype, device="cpu"
    )
    scale = head_dim**-0.5
    got = CpuAttention().forward(query, k_cache, v_cache, meta, scale)
    assert got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), reference(query, k_cache, v_cache, meta, scale), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("window", [1, 5, 20, 1000])
def test_sliding_window_matches_reference(window):
    specs = batch_specs(16) + [(40, 30), (1, 90)]  # prefill tiles that start past the window
    query, k_cache, v_cache, meta = make_batch(specs, 16, 4, 2, 64, torch.float32, device="cpu")
    got = CpuAttention().forward(query, k_cache, v_cache, meta, 0.125, window)
    want = reference(query, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_long_contexts_and_large_scores_stay_exact():
    # Large logits: the softmax must subtract its max (exp of ~1e3 would overflow otherwise).
    specs = [(1, 3000), (37, 2000), (1, 1)]
    query, k_cache, v_cache, meta = make_batch(
        specs, 16, 8, 2, 128, torch.float32, seed=5, device="cpu"
    )
    query = query * 30
    got = CpuAttention().forward(query, k_cache, v_cache, meta, 128**-0.5)
    want = reference(query, k_cache, v_cache, meta, 128**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_does_not_change_the_result(threads):
    query, k_cache, v_cache, meta = make_batch(
        batch_specs(16) * 3, 16, 8, 2, 64, torch.float32, device="cpu"
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = CpuAttention().forward(query, k_cache, v_cache, meta, 0.125)
        torch.set_num_threads(threads)
        many = CpuAttention().forward(query, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # each (sequence, row tile) is computed by one thread alone


@pytest.mark.parametrize("window", [0, 700, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_decodes_split_into_parts_match_the_reference(window, dtype):
    # Decodes past 512 keys are computed in aligned parts of 512 and merged: contexts that end
    # on, just past and well past a part boundary, and windows that start mid-part.
    specs = [(1, 511), (1, 512), (1, 1023), (1, 2000), (3, 900), (1, 40)]
    query, k_cache, v_cache, meta = make_batch(specs, 16, 8, 2, 64, dtype, seed=3, device="cpu")
    got = CpuAttention().forward(query * 8, k_cache, v_cache, meta, 0.125, window)
    want = reference(query * 8, k_cache, v_cache, meta, 0.125, window)
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 700])
def test_soft_capped_scores_match_the_reference(window):
    # Gemma 2's cap (c * tanh(score / c) before the softmax): prefill tiles, plain decodes and
    # decodes split into parts, against the reference's own capped path; scores large enough
    # that the cap bends them.
    specs = [(1, 40), (37, 300), (1, 1023), (1, 2000)]
    query, k_cache, v_cache, meta = make_batch(
        specs, 16, 8, 2, 64, torch.float32, seed=7, device="cpu"
    )
    query = query * 8
    got = CpuAttention().forward(query, k_cache, v_cache, meta, 0.125, window, softcap=2.0)
    want = TorchAttention().forward(query, k_cache, v_cache, meta, 0.125, window, softcap=2.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    uncapped = reference(query, k_cache, v_cache, meta, 0.125, window)
    assert (got - uncapped).abs().max() > 1e-2  # the cap changed the result


@pytest.mark.parametrize("window,dtype", [(0, torch.float32), (700, torch.bfloat16)])
def test_sinks_match_the_reference(window, dtype):
    # gpt-oss's sinks (a logit per head in each softmax's sum): prefill tiles, plain decodes and
    # decodes split into parts (the sink counted once, in the merge), against the reference;
    # sinks large enough to take most of some heads' probability.
    specs = [(1, 40), (37, 300), (1, 1023), (1, 2000)]
    query, k_cache, v_cache, meta = make_batch(specs, 16, 8, 2, 64, dtype, seed=9, device="cpu")
    sinks = torch.linspace(-3.0, 6.0, 8)
    got = CpuAttention().forward(query * 4, k_cache, v_cache, meta, 0.125, window, sinks=sinks)
    want = TorchAttention().forward(
        (query * 4).float(), k_cache.float(), v_cache.float(), meta, 0.125, window, sinks=sinks
    )
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    plain = reference(query * 4, k_cache, v_cache, meta, 0.125, window)
    assert (got.float() - plain).abs().max() > 1e-2  # the sinks changed the result


# How far a narrower cache may move the output from a float32 cache's: the rounding of K and V
# (FP8 E5M2 keeps 2 bits of mantissa: up to 1/8 of each element, seen 0.22 where few keys
# dominate a row; E4M3 3 bits)
NARROW_TOL = {**TOL, torch.float8_e5m2: 0.3, torch.float8_e4m3fn: 0.15}
FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, *FP8])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_a_narrower_cache_under_a_float32_query(cache_dtype, head_dim):
    """--kv-cache-dtype: the kernel widens each K/V element as it reads it and computes in
    float32, so the result is the float32 reference's over the widened cache (split decodes,
    prefill tiles and the generic head size included)."""
    specs = batch_specs(16) + [(1, 1200), (20, 700)]
    query, k_cache, v_cache, meta = make_batch(
        specs, 16, 8, 2, head_dim, torch.float32, seed=7, device="cpu"
    )
    kn, vn = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    got = CpuAttention().forward(query, kn, vn, meta, head_dim**-0.5)
    assert got.dtype == torch.float32
    want = reference(query, kn, vn, meta, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and it differs from the float32 cache's by no more than the rounding of K and V
    full = reference(query, k_cache, v_cache, meta, head_dim**-0.5)
    tol = NARROW_TOL[cache_dtype]
    torch.testing.assert_close(got, full, atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_an_fp8_cache_under_a_16_bit_query(fp8, dtype, head_dim):
    """An FP8 cache under a 16-bit model (--kv-cache-dtype fp8 / fp8_e5m2, where it halves the
    cache): the kernel's result over the widened cache is the reference's to the query dtype's
    rounding."""
    specs = batch_specs(16) + [(1, 900), (12, 300)]
    query, k_cache, v_cache, meta = make_batch(
        specs, 16, 8, 2, head_dim, dtype, seed=11, device="cpu"
    )
    k8, v8 = k_cache.to(fp8), v_cache.to(fp8)
    got = CpuAttention().forward(query, k8, v8, meta, head_dim**-0.5)
    assert got.dtype == dtype
    want = reference(query, k8, v8, meta, head_dim**-0.5)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    # the element type is the kernel's to check, not its caller's alone
    with pytest.raises(ValueError, match="unsupported dtypes"):
        cpu_build.load().paged_attention(
            query, k8, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            0.1, 0, 0.0, None,
        )  # fmt: skip


@pytest.mark.parametrize("fp8", FP8)
def test_every_fp8_code_widens_as_torch_widens_it(fp8):
    """Caches of every FP8 code but NaN, drawn at random (subnormals, the largest values, both
    signs): the kernel's vector and scalar conversions (head size 80: 16-element chunks and a
    tail) read what torch's .float() reads."""
    specs = [(1, 300), (5, 40)]
    query, k_cache, v_cache, meta = make_batch(specs, 16, 4, 2, 80, torch.float32, device="cpu")
    g = torch.Generator().manual_seed(5)
    nan = {torch.float8_e5m2: 0x7C, torch.float8_e4m3fn: 0x7F}[fp8]  # from here up: NaN / inf
    caches = []
    for _ in range(2):
        codes = torch.randint(0, 256, k_cache.shape, generator=g, dtype=torch.uint8)
        codes = torch.where((codes & 0x7F) >= nan, codes & 0x80, codes)
        caches.append(codes.view(fp8))
    k8, v8 = caches
    query = query / 64  # scores of a few units over K up to 57344 (E5M2's largest)
    got = CpuAttention().forward(query, k8, v8, meta, 80**-0.5 / 1000)
    want = reference(query, k8, v8, meta, 80**-0.5 / 1000)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_a_split_decode_is_the_same_in_any_batch_and_on_any_thread_count():
    """A sequence's parts depend on its length alone: alone or beside others, on one thread or
    three, its output is the same to the bit (the same seed gives the same tokens in any
    batch)."""
    specs = [(1, 1500), (1, 700), (4, 30), (1, 2500)]
    query, k_cache, v_cache, meta = make_batch(specs, 16, 8, 2, 64, torch.float32, device="cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = CpuAttention().forward(query, k_cache, v_cache, meta, 0.125)
        torch.set_num_threads(3)
        again = CpuAttention().forward(query, k_cache, v_cache, meta, 0.125)
        first = AttentionMetadata.build(
            [0], meta.block_tables[:1].tolist(), [1], [1501], lambda d, t: torch.tensor(d, dtype=t)
        )
        alone = CpuAttention().forward(query[:1], k_cache, v_cache, first, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, again)
    assert torch.equal(alone[0], together[0])


def test_rejects_what_it_cannot_run():
    query, k_cache, v_cache, meta = make_batch(
        batch_specs(16), 16, 4, 2, 64, torch.float32, device="cpu"
    )
    with pytest.raises(ValueError, match="dtypes"):
        CpuAttention().forward(query.double(), k_cache.double(), v_cache.double(), meta, 0.125)
    with pytest.raises(ValueError, match="dtypes"):  # a cache wider than the query
        CpuAttention().forward(query.bfloat16(), k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="dtypes"):  # 16-bit of the other kind
        CpuAttention().forward(query.bfloat16(), k_cache.half(), v_cache.half(), meta, 0.125)
    with pytest.raises(ValueError, match="dtypes"):  # K and V of different kinds
        CpuAttention().forward(query, k_cache.half(), v_cache.bfloat16(), meta, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        CpuAttention().forward(query, k_cache.transpose(1, 2), v_cache, meta, 0.125)


def test_auto_picks_the_kernel_on_cpu_and_builds_it_once():
    # the cache every other test uses (a build of its own here took 38 s of the suite's time)
    assert get_backend("auto", torch.device("cpu")).name == "cpu"
    path = cpu_build.build()
    assert path.parent.parent == cache_dir() and path.stat().st_size > 0
    mtime = path.stat().st_mtime_ns
    assert cpu_build.build() == path and path.stat().st_mtime_ns == mtime  # cached, not rebuilt


def test_every_header_is_in_the_build_key():
    """The cache is keyed by the sources and the headers build.py names: a header left out would
    serve a stale build after it changes."""
    from gpu.cpu.build import CSRC, HEADERS

    assert {p.name for p in CSRC.glob("*.h")} == {p.name for p in HEADERS}


def test_a_compiler_error_is_reported(tmp_path, monkeypatch):
    # the broken source alone: the failure is reported without compiling the real ones first
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    for sources in ("QUANT", "BINDINGS", "HEADERS"):
        monkeypatch.setattr(cpu_build, sources, [])
    monkeypatch.setattr(cpu_build, "QUANT_PATHS", {})
    monkeypatch.setattr(cpu_build, "KERNELS", [bad])
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path))
    with pytest.raises(cpu_build.BuildError, match="bad.cpp.* failed"):
        cpu_build.build()


def test_an_unwritable_cache_is_a_build_error_not_a_crash(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache path runs through a file: mkdir fails
    monkeypatch.setenv("WEIR_CACHE", str(blocker / "cache"))
    with pytest.raises(cpu_build.BuildError, match="could not build"):
        cpu_build.build()
