// Element conversions (16-bit and FP8 K/V caches) and AVX-512 inner loops of the CPU paged
// attention (attention.cpp): the algorithm there, the vector primitives here. Header-only,
// included in one translation unit each (attention.cpp, forward.cpp's K/V writes), so
// everything is inline in an anonymous namespace.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t bf16) {  // bfloat16 bits
    uint32_t u = uint32_t(bf16) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float to_f32(_Float16 h) { return float(h); }

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        *p = uint16_t((u >> 16) | 0x40);  // NaN stays NaN
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = uint16_t(u >> 16);
}
inline void store(_Float16* p, float x) { *p = _Float16(x); }

// FP8 E5M2 (--kv-cache-dtype fp8_e5m2): float16's upper byte, so 1 sign, 5 exponent and 2
// mantissa bits with float16's exponent bias; widened exactly through float16.
struct Fp8E5M2 {
    uint8_t bits;
};
inline float to_f32(Fp8E5M2 x) {
    const uint16_t h = uint16_t(x.bits) << 8;
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return float(f);
}
// float32 to an 8-bit float (exponent bias kBias, kMant mantissa bits), rounded to nearest, ties to
// even, straight from float32 as torch's .to() rounds (through float16 would round twice): at
// and past `limit` (float32 bits) to `over`, NaN to 0x7f; below the smallest normal,
// 2^(1 - kBias), to a multiple of the subnormals' unit: added to a float whose float32 ulp is
// that unit, x is rounded by the addition itself, and the units count up from the subnormals
// into the first normal. Else the exponent is rebiased and the mantissa rounded at its lowest
// kept bit.
template <uint32_t kBias, uint32_t kMant>
inline uint8_t to_fp8(float x, uint32_t limit, uint8_t over) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u > 0x7f800000u) {
        r = 0x7f;  // NaN
    } else if (u >= limit) {
        r = over;
    } else if (u < (128u - kBias) << 23) {
        float f, big;
        const uint32_t big_bits = (127u + 24 - kBias - kMant) << 23;
        std::memcpy(&f, &u, 4);
        std::memcpy(&big, &big_bits, 4);
        f += big;
        uint32_t fb;
        std::memcpy(&fb, &f, 4);
        r = uint8_t(fb - big_bits);
    } else {
        constexpr uint32_t kShift = 23 - kMant;
        u += ((kBias - 127u) << 23) + ((1u << (kShift - 1)) - 1) + ((u >> kShift) & 1u);
        r = uint8_t(u >> kShift);
    }
    return uint8_t(r | (sign >> 24));
}
// Past the largest finite value (57344), from 2^16 on, to infinity.
inline void store(Fp8E5M2* p, float x) {
    *p = Fp8E5M2{to_fp8<15, 2>(x, (127u + 16) << 23, 0x7c)};
}

// FP8 E4M3 (--kv-cache-dtype fp8_e4m3, vLLM's fp8): 4 exponent bits (bias 7) and 3 of mantissa,
// no infinity, one NaN (S.1111.111), so its largest value is 448. Read as a float16 whose
// exponent is 8 too small (widen below), the 256 applied by the attention.
struct Fp8E4M3 {
    uint8_t bits;
};
// Saturated to +-448 (0x43e00000 and up, infinity included), as vLLM's FP8 cache writes are
// (torch's .to() makes NaN of what is past 464).
inline void store(Fp8E4M3* p, float x) { *p = Fp8E4M3{to_fp8<7, 3>(x, 0x43e00000u, 0x7e)}; }

// dst[e] = float(src[e]) for e < n: a 16-bit K/V chunk widened for the float inner loops.
inline void widen(const uint16_t* src, int64_t n, float* dst) {
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= n; e += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e)));
        _mm512_storeu_ps(dst + e, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#elif defined(__AVX2__)
    for (; e + 8 <= n; e += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)));
        _mm256_storeu_ps(dst + e, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; e < n; ++e) dst[e] = to_f32(src[e]);
}
inline void widen(const _Float16* src, int64_t n, float* dst) {
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= n; e += 16)
        _mm512_storeu_ps(dst + e, _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e))));
#elif defined(__F16C__)
    for (; e + 8 <= n; e += 8)
        _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e))));
#endif
    for (; e < n; ++e) dst[e] = to_f32(src[e]);
}

inline void widen(const Fp8E5M2* src, int64_t n, float* dst) {
    [[maybe_unused]] const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= n; e += 16) {
        const __m256i h = _mm256_slli_epi16(
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + e))), 8);
        _mm512_storeu_ps(dst + e, _mm512_cvtph_ps(h));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    for (; e + 8 <= n; e += 8) {
        const __m128i h = _mm_slli_epi16(
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + e))), 8);
        _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(h));
    }
#endif
    for (; e < n; ++e) dst[e] = to_f32(src[e]);
}

// E4M3 widened in units of 2^-8 (kv_unit below: the attention multiplies by 256 where it is
// cheaper, in the query and the output): its byte in a float16's upper half, shifted right by
// one with the sign kept and bit 14 cleared, is a float16 of the same sign, exponent field and
// mantissa, whose exponent bias is 8 more than E4M3's (every E4M3 value is a float16 normal
// there). The NaN code (S.1111.111) reads as 480, a number: checking for it cost the
// attention a fifth of its time at 4 query heads a KV head. The writes saturate, so only a
// NaN K or V writes it (its own token's output NaN already), and the kernel is built
// finite-only (-ffast-math): no NaN is defined through it anyway.
inline float to_units(Fp8E4M3 x) {
    const uint16_t h = uint16_t((x.bits & 0x80) << 8 | (x.bits & 0x7f) << 7);
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return float(f);
}
inline void widen(const Fp8E4M3* src, int64_t n, float* dst) {
    [[maybe_unused]] const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
    int64_t e = 0;
#if defined(__AVX512F__)
    const __m256i keep = _mm256_set1_epi16(int16_t(0xbfff));
    for (; e + 16 <= n; e += 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + e));
        const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
        _mm512_storeu_ps(dst + e,
                         _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(w, 1), keep)));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i keep = _mm_set1_epi16(int16_t(0xbfff));
    for (; e + 8 <= n; e += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + e));
        const __m128i h = _mm_and_si128(
            _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes), 1), keep);
        _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(h));
    }
#endif
    for (; e < n; ++e) dst[e] = to_units(src[e]);
}

// What a widened element of cache type C is in (the attention scales by it once).
template <typename C>
constexpr float kv_unit = 1.f;
template <>
constexpr float kv_unit<Fp8E4M3> = 256.f;

// dst[e] = src[e] rounded to T, as torch's .to(dtype) rounds (nearest, ties to even): K/V rows
// written into a 16-bit cache.
inline void narrow(const float* src, int64_t n, float* dst) {
    std::memcpy(dst, src, sizeof(float) * n);
}
inline void narrow(const float* src, int64_t n, uint16_t* dst) {
    int64_t e = 0;
#if defined(__AVX512F__)
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    for (; e + 16 <= n; e += 16) {
        const __m512 x = _mm512_loadu_ps(src + e);
        const __m512i u = _mm512_castps_si512(x);
        __m512i r = _mm512_add_epi32(
            u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        r = _mm512_srli_epi32(r, 16);
        // NaN stays NaN (quiet), as in the scalar store.
        const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; e < n; ++e) store(dst + e, src[e]);
}
inline void narrow(const float* src, int64_t n, _Float16* dst) {
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= n; e += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; e < n; ++e) store(dst + e, src[e]);
}
inline void narrow(const float* src, int64_t n, Fp8E5M2* dst) {
    for (int64_t e = 0; e < n; ++e) store(dst + e, src[e]);
}
inline void narrow(const float* src, int64_t n, Fp8E4M3* dst) {
    for (int64_t e = 0; e < n; ++e) store(dst + e, src[e]);
}

#ifdef __AVX512F__
// AVX-512 inner loops for head sizes that are a multiple of 16 (one zmm holds 16 floats).
// Scores: one query against up to 16 keys as 16 vertical accumulators, then one transposed
// reduction tree (45 shuffles and adds) gives the 16 dot products in order, instead of a
// horizontal reduction per key (about 8 operations each). Weighted sum: 16 accumulator
// registers held over a whole chunk, each value row loaded once for a group of queries: faster
// than the portable loops below (figures: docs/benchmarks.md, "Figures moved out of the code").
inline __m512 reduce16(__m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // c[k] holds, in each 128-bit lane l, the lane-l partial sums of keys 4k..4k+3.
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// st[j] = q . k_j for the n <= 16 keys k_j = k + j * slot.
template <int64_t D>
inline void scores16(const float* __restrict q, const float* k, int64_t slot, int64_t n,
                     float* st) {
    constexpr int C = D / 16;
    __m512 qv[C], acc[16];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int j = 0; j < 16; ++j) {
        if (j < n) {
            const float* kj = k + j * slot;
            __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
            for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + 16 * c), s);
            acc[j] = s;
        } else {
            acc[j] = _mm512_setzero_ps();
        }
    }
    _mm512_mask_storeu_ps(st, __mmask16((1u << n) - 1u), reduce16(acc));
}

// acc_i += sum_j p_i[j] v_j for the nq queries i of one KV head and the n keys v_j = v + j * slot,
// p_i = p + i * pstride; 16 accumulator registers at a time, each value row loaded once per
// group of queries.
template <int64_t D>
inline void wsum16(const float* v, int64_t slot, int64_t n, const float* p, int64_t pstride,
                   float* acc, int64_t nq) {
    constexpr int C = D / 16;
    constexpr int QG = C >= 16 ? 1 : 16 / C;  // queries per group: 16 accumulators
    for (int64_t i0 = 0; i0 < nq; i0 += QG) {
        const int qg = int(std::min<int64_t>(QG, nq - i0));
        __m512 a[QG][C];
        for (int i = 0; i < qg; ++i)
            for (int c = 0; c < C; ++c) a[i][c] = _mm512_loadu_ps(acc + (i0 + i) * D + 16 * c);
        for (int64_t j = 0; j < n; ++j) {
            const float* vj = v + j * slot;
            __m512 vr[C];
            for (int c = 0; c < C; ++c) vr[c] = _mm512_loadu_ps(vj + 16 * c);
            for (int i = 0; i < qg; ++i) {
                const __m512 pj = _mm512_set1_ps(p[(i0 + i) * pstride + j]);
                for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(pj, vr[c], a[i][c]);
            }
        }
        for (int i = 0; i < qg; ++i)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (i0 + i) * D + 16 * c, a[i][c]);
    }
}
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
template <int64_t D>
inline void scores16(const float*, const float*, int64_t, int64_t, float*) {}
template <int64_t D>
inline void wsum16(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t) {}
#endif

}  // namespace
