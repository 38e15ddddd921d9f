// The AVX-512 path of the block- and 16-bit-format products (quant.cpp): VNNI's 8-bit dot product
// (vpdpbusd, 64 multiply-adds an instruction: the weight's unsigned integers against the
// activations' int8, one 32-bit lane a column) and AVX-512 BF16's pair dot product (vdpbf16ps).
// Built with these instruction sets whatever the build machine has; called only where the CPU
// has them (quant.cpp qpath_available). Same integers and float operations in the same order as
// the reference (quant_layout.h): tests/test_cpu_quant.py holds it to the reference bit for bit.
//
// Up to eight rows (four for 16-bit formats) keep their sums in registers across the whole of
// k: each block (32 weights of k) of the panel (16 columns) is decoded once into eight
// registers, one per quad of k, and run against each of the rows; a row's two sums (even and odd
// blocks) are two independent chains.

#if defined(__x86_64__)

#include <immintrin.h>

#include "quant_layout.h"

namespace weir::q {

namespace {

// The helpers below run once a block (32 weights of k, 16 columns): each one inlined, so that
// a pass keeps its sums and the block's decoded integers in registers. Left to itself g++ called
// block<>() for the k-quants, Q4_0 and Q4_1 and decode<>() for Q5_K and Q6_K, passing the sums
// and the integers through the stack on every block.
#define WEIR_INLINE inline __attribute__((always_inline))

// rows held in registers at a time: block and 16-bit formats keep two sums a row
constexpr int kRows = 8;
constexpr int kHalfRows = 8;

WEIR_INLINE __m512i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

WEIR_INLINE __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

WEIR_INLINE __m512 u8x16(const uint8_t* p, bool is_signed) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// The low (or high) nibbles of 16 bytes as floats (Q2_K's scales and minimums).
WEIR_INLINE __m512 nib16(const uint8_t* p, bool high) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (high) b = _mm_srli_epi16(b, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
}

// The block's integers, one register per quad of k (t = 0..7).
template <int F>
WEIR_INLINE void decode(const uint8_t* ints, __m512i w[8]) {
    constexpr int bits = geometry(F).bits;
    if constexpr (bits == 8) {
        for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(ints + 64 * t);
        return;
    }
    if constexpr (bits <= 3) {
        const __m512i low2 = _mm512_set1_epi8(3), bit2 = _mm512_set1_epi8(4);
        for (int p = 0; p < 2; ++p) {
            const __m512i v = _mm512_loadu_si512(ints + 64 * p);
            for (int j = 0; j < 4; ++j) w[p + 2 * j] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * j), low2);
        }
        if constexpr (bits == 2) return;
        const __m512i hb = _mm512_loadu_si512(ints + 128);
        for (int t = 0; t < 8; ++t) {
            // bit t of each byte, moved to bit 2
            const __m512i moved = t <= 2 ? _mm512_slli_epi16(hb, 2 - t) : _mm512_srli_epi16(hb, t - 2);
            w[t] = _mm512_or_si512(w[t], _mm512_and_si512(moved, bit2));
        }
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(ints + 64 * t);
        w[t] = _mm512_and_si512(v, low4);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (is_iq(F)) {  // indices to their values' u
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(iq_u(F))));
        for (int t = 0; t < 8; ++t) w[t] = _mm512_shuffle_epi8(table, w[t]);
    }
    if constexpr (bits == 5) {
        const __m512i hb = _mm512_loadu_si512(ints + 256);
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        for (int t = 0; t < 8; ++t) {
            // bit t of each byte, moved to bit 4
            const __m512i moved = t <= 4 ? _mm512_slli_epi16(hb, 4 - t) : _mm512_srli_epi16(hb, t - 4);
            w[t] = _mm512_or_si512(w[t], _mm512_and_si512(moved, bit4));
        }
    } else if constexpr (bits == 6) {
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
            const __m512i hb = _mm512_loadu_si512(ints + 256 + 64 * h);
            for (int j = 0; j < 4; ++j) {
                // bits 2j, 2j + 1 of each byte, moved to bits 4, 5
                const __m512i moved = j <= 2 ? _mm512_slli_epi16(hb, 4 - 2 * j) : _mm512_srli_epi16(hb, 2);
                w[4 * h + j] = _mm512_or_si512(w[4 * h + j], _mm512_and_si512(moved, bits45));
            }
        }
    }
}

// The 4-byte dot products of quads t0..t0+3 of w against a row's quads, as two chains.
WEIR_INLINE __m512i dot4(const __m512i* w, const int8_t* xq, int t0) {
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[t0], bcast4(xq + 4 * t0));
    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[t0 + 1], bcast4(xq + 4 * t0 + 4));
    a = _mm512_dpbusd_epi32(a, w[t0 + 2], bcast4(xq + 4 * t0 + 8));
    b = _mm512_dpbusd_epi32(b, w[t0 + 3], bcast4(xq + 4 * t0 + 12));
    return _mm512_add_epi32(a, b);
}

WEIR_INLINE __m512 update(__m512 e, __m512i dot, __m512 alpha, __m512 beta, float dx, float xs) {
    const __m512 ad = _mm512_mul_ps(alpha, _mm512_set1_ps(dx));
    e = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ad, e);
    return _mm512_fnmadd_ps(beta, _mm512_set1_ps(xs), e);
}

// Walks a panel's blocks: the k-quants' headers, each block's scales and integers.
struct Cursor {
    const uint8_t* at;
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
};

// Block b of the panel into the rows' sums e (one of the two chains).
template <int F, int R>
WEIR_INLINE void block(Cursor& cur, int64_t b, const Acts& a, int64_t r0, int64_t nb, __m512 (&e)[R]) {
    constexpr Geometry g = geometry(F);
    if constexpr (g.header != 0) {
        if (b % 8 == 0) {
            cur.d = f16x16(cur.at);
            if constexpr (has_dmin(F)) cur.dmin = f16x16(cur.at + 32);
            cur.at += g.header;
        }
    }
    const uint8_t* scales = cur.at;
    const uint8_t* ints = cur.at + g.scales;
    cur.at += g.scales + g.ints;
    __m512 alpha[2], beta[2];
    if constexpr (is_d_only(F)) {
        alpha[0] = f16x16(scales);
        beta[0] = _mm512_mul_ps(_mm512_set1_ps(zero_u(F)), alpha[0]);
    } else if constexpr (is_d_m(F)) {
        alpha[0] = f16x16(scales);
        beta[0] = _mm512_sub_ps(_mm512_setzero_ps(), f16x16(scales + 32));
    } else if constexpr (is_sc16(F)) {
        for (int h = 0; h < 2; ++h) {
            alpha[h] = _mm512_mul_ps(cur.d, u8x16(scales + 16 * h, true));
            if constexpr (scale_unit(F) != 1.f) alpha[h] = _mm512_mul_ps(alpha[h], _mm512_set1_ps(scale_unit(F)));
            beta[h] = _mm512_mul_ps(_mm512_set1_ps(sc16_zero(F)), alpha[h]);
        }
    } else if constexpr (is_xs(F)) {
        alpha[0] = _mm512_mul_ps(cur.d, u8x16(scales, true));
        if constexpr (scale_unit(F) != 1.f) alpha[0] = _mm512_mul_ps(alpha[0], _mm512_set1_ps(scale_unit(F)));
        beta[0] = _mm512_mul_ps(_mm512_set1_ps(128.f), alpha[0]);
    } else if constexpr (F == kWQ2_K) {
        for (int h = 0; h < 2; ++h) {
            alpha[h] = _mm512_mul_ps(cur.d, nib16(scales + 16 * h, false));
            beta[h] = _mm512_mul_ps(cur.dmin, nib16(scales + 16 * h, true));
        }
    } else {
        alpha[0] = _mm512_mul_ps(cur.d, u8x16(scales, false));
        beta[0] = _mm512_mul_ps(cur.dmin, u8x16(scales + 16, false));
    }
    __m512i w[8];
    decode<F>(ints, w);
    for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.xq + (r0 + r) * a.k + b * 32;
        const int64_t blk = (r0 + r) * nb + b;
        if constexpr (g.halves == 2) {
            e[r] = update(e[r], dot4(w, xq, 0), alpha[0], beta[0], a.dx[blk], a.xs16[2 * blk]);
            e[r] = update(e[r], dot4(w, xq, 4), alpha[1], beta[1], a.dx[blk], a.xs16[2 * blk + 1]);
        } else {
            const __m512i dot = _mm512_add_epi32(dot4(w, xq, 0), dot4(w, xq, 4));
            e[r] = update(e[r], dot, alpha[0], beta[0], a.dx[blk], a.xs[blk]);
        }
    }
}

// Lines of `next` up to the offset the cursor has reached in this panel, into L2 (`*fetched`:
// the offset fetched so far).
WEIR_INLINE void fetch_along(const uint8_t* panel, const Cursor& cur, const uint8_t* next,
                        int64_t* fetched) {
    for (const int64_t to = cur.at - panel; *fetched < to; *fetched += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + *fetched), _MM_HINT_T1);
}

// `next`: as for the 16-bit formats' halves below, the panel after this one, fetched along.
template <int F, int R>
void blocks(const uint8_t* panel, const Acts& a, int64_t r0, float* out, const uint8_t* next) {
    const int64_t nb = a.k / 32;
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    Cursor cur{panel};
    int64_t b = 0, fetched = 0;
    for (; b + 2 <= nb; b += 2) {
        block<F, R>(cur, b, a, r0, nb, even);
        block<F, R>(cur, b + 1, a, r0, nb, odd);
        if (next) fetch_along(panel, cur, next, &fetched);
    }
    if (b < nb) block<F, R>(cur, b, a, r0, nb, even);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * kPanel, _mm512_add_ps(even[r], odd[r]));
}

template <int F>
void blocks_rows(const uint8_t* panel, const Acts& a, int64_t rows, float* out) {
    // with two passes or more, the last fetches the next panel (one pass: memory streams it)
    const uint8_t* next = panel + panel_bytes(F, a.k);
    const int64_t last = rows > kRows ? (rows - 1) / kRows * kRows : -1;
    int64_t r0 = 0;
    for (; r0 + kRows <= rows; r0 += kRows)
        blocks<F, kRows>(panel, a, r0, out, r0 == last ? next : nullptr);
    const uint8_t* n = r0 == last ? next : nullptr;
    switch (rows - r0) {
        case 1: blocks<F, 1>(panel, a, r0, out, n); break;
        case 2: blocks<F, 2>(panel, a, r0, out, n); break;
        case 3: blocks<F, 3>(panel, a, r0, out, n); break;
        case 4: blocks<F, 4>(panel, a, r0, out, n); break;
        case 5: blocks<F, 5>(panel, a, r0, out, n); break;
        case 6: blocks<F, 6>(panel, a, r0, out, n); break;
        case 7: blocks<F, 7>(panel, a, r0, out, n); break;
        default: break;
    }
}

// ---- 16-bit formats: two sums per row, pair p of k into sum p % 2 ----
WEIR_INLINE __m512 pair_bcast(const uint16_t* x) {
    uint32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(int(v)));
}

// Pair p of an F16 panel as (even k, odd k) floats for its 16 columns.
WEIR_INLINE void f16_pair(const uint8_t* wp, __m512& w0, __m512& w1) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 lo = f16x16(wp), hi = f16x16(wp + 32);
    w0 = _mm512_permutex2var_ps(lo, even, hi);
    w1 = _mm512_permutex2var_ps(lo, odd, hi);
}

template <bool BF, int R>
WEIR_INLINE void pair(const uint8_t* panel, int64_t p, const void* x, int64_t stride, int64_t r0,
                 __m512 (&e)[R]) {
    if constexpr (BF) {
        const __m512bh wp = (__m512bh)_mm512_loadu_si512(panel + 64 * p);
        for (int r = 0; r < R; ++r) {
            const uint16_t* xr = static_cast<const uint16_t*>(x) + (r0 + r) * stride + 2 * p;
            e[r] = _mm512_dpbf16_ps(e[r], wp, (__m512bh)pair_bcast(xr));
        }
    } else {
        __m512 w0, w1;
        f16_pair(panel + 64 * p, w0, w1);
        for (int r = 0; r < R; ++r) {
            const float* xr = static_cast<const float*>(x) + (r0 + r) * stride + 2 * p;
            e[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), w1, e[r]);
            e[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), w0, e[r]);
        }
    }
}

// `next`: the panel after this one in memory, fetched into L2 a line a pair (the last pass over
// this panel, which reads it from L2, does it) so that the next panel's first pass does not
// wait on memory.
template <bool BF, int R>
void halves(const uint8_t* panel, int64_t k, const void* x, int64_t stride, int64_t r0,
            float* out, const uint8_t* next) {
    __m512 e0[R], e1[R];
    for (int r = 0; r < R; ++r) e0[r] = e1[r] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) {
        if (next) {  // a pair of a panel is one 64-byte line
            _mm_prefetch(reinterpret_cast<const char*>(next + 64 * p), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(next + 64 * p + 64), _MM_HINT_T1);
        }
        pair<BF, R>(panel, p, x, stride, r0, e0);
        pair<BF, R>(panel, p + 1, x, stride, r0, e1);
    }
    if (p < pairs) pair<BF, R>(panel, p, x, stride, r0, e0);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * kPanel, _mm512_add_ps(e0[r], e1[r]));
}

template <bool BF>
void halves_rows(const uint8_t* panel, int64_t k, const void* x, int64_t stride, int64_t rows,
                 float* out) {
    // with two passes or more, the last fetches the next panel (one pass: memory streams it)
    const uint8_t* next = panel + panel_bytes(BF ? kWBF16 : kWF16, k);
    const int64_t last = rows > kHalfRows ? (rows - 1) / kHalfRows * kHalfRows : -1;
    int64_t r0 = 0;
    for (; r0 + kHalfRows <= rows; r0 += kHalfRows)
        halves<BF, kHalfRows>(panel, k, x, stride, r0, out, r0 == last ? next : nullptr);
    const uint8_t* n = r0 == last ? next : nullptr;
    switch (rows - r0) {
        case 1: halves<BF, 1>(panel, k, x, stride, r0, out, n); break;
        case 2: halves<BF, 2>(panel, k, x, stride, r0, out, n); break;
        case 3: halves<BF, 3>(panel, k, x, stride, r0, out, n); break;
        case 4: halves<BF, 4>(panel, k, x, stride, r0, out, n); break;
        case 5: halves<BF, 5>(panel, k, x, stride, r0, out, n); break;
        case 6: halves<BF, 6>(panel, k, x, stride, r0, out, n); break;
        case 7: halves<BF, 7>(panel, k, x, stride, r0, out, n); break;
        default: break;
    }
}

}  // namespace

void panel_avx512(int format, const uint8_t* panel, const Acts& a, const void* x16,
                  int64_t x16_stride, int64_t rows, float* out) {
    switch (format) {
        case kWBF16: return halves_rows<true>(panel, a.k, x16, x16_stride, rows, out);
        case kWF16: return halves_rows<false>(panel, a.k, x16, x16_stride, rows, out);
        default:
            with_block_format(format, [&](auto f) { blocks_rows<decltype(f)::value>(panel, a, rows, out); });
    }
}

}  // namespace weir::q

#endif
