// The AVX2 path of the block- and 16-bit-format products (quant.cpp), for x86 CPUs without
// AVX-512: maddubs (unsigned 8-bit weights times int8 activations, pairs summed to int16) and
// madd (pairs of those summed to int32) make the 4-byte dot product per 32-bit lane that VNNI
// does in one instruction. Built with AVX2, FMA and F16C whatever the build machine has; called
// only where the CPU has them. Same integers and float operations as the reference
// (quant_layout.h update): tests/test_cpu_quant.py holds it to the reference.
//
// A 16-column panel is two halves of 8 columns, one register each. No int16 sum can saturate:
// 4-, 5- and 6-bit weights times |x| <= 127 stay within 2 * 63 * 127, and up to four quads'
// maddubs are added in int16 before one madd where their bits leave room (group_of); Q8_0's
// weights (0..255) and IQ4's values are taken signed (q = u - 128), their magnitude against x
// with q's sign (maddubs(|q|, sign(x, q)), exact for every q in -128..127 as |x| <= 127), and
// A = sum x q + 128 sum x. The block formats' pass is a template per format, as the AVX-512
// path's is (a format decided per block at run time cost 14-42% on one row, 2-18% on 16-64).

#if defined(__x86_64__)

#include <immintrin.h>

#include "quant_layout.h"

namespace weir::q {

namespace {

// Once a block: each inlined, so that a block's decoded integers stay in registers.
#define WEIR_INLINE inline __attribute__((always_inline))

WEIR_INLINE __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

inline __m256i load(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Half c of the block's integers, one register per quad of k (t = 0..7); Q8_0's as |q| in w and
// q in sign, q = u - 128.
template <int format>
WEIR_INLINE void decode(const uint8_t* ints, int c, __m256i w[8], __m256i sign[8]) {
    constexpr int bits = geometry(format).bits;
    if (bits == 8) {
        const __m256i flip = _mm256_set1_epi8(char(0x80));
        for (int t = 0; t < 8; ++t) {
            sign[t] = _mm256_xor_si256(load(ints + 64 * t + 32 * c), flip);
            w[t] = _mm256_abs_epi8(sign[t]);
        }
        return;
    }
    if (bits <= 3) {
        const __m256i low2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
        for (int p = 0; p < 2; ++p) {
            const __m256i v = load(ints + 64 * p + 32 * c);
            for (int j = 0; j < 4; ++j) w[p + 2 * j] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), low2);
        }
        if (bits == 2) return;
        const __m256i hb = load(ints + 128 + 32 * c);
        for (int t = 0; t < 8; ++t) {
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hb, t), one);
            w[t] = _mm256_or_si256(w[t], _mm256_slli_epi16(bit, 2));
        }
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
        const __m256i v = load(ints + 64 * t + 32 * c);
        w[t] = _mm256_and_si256(v, low4);
        w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if (is_iq(format)) {  // indices to their signed values, taken as Q8_0's are (q = u - 128)
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_load_si128(reinterpret_cast<const __m128i*>(iq_values(format))));
        for (int t = 0; t < 8; ++t) {
            sign[t] = _mm256_shuffle_epi8(table, w[t]);
            w[t] = _mm256_abs_epi8(sign[t]);
        }
        return;
    }
    if (bits == 5) {
        const __m256i hb = load(ints + 256 + 32 * c);
        const __m256i one = _mm256_set1_epi8(1);
        for (int t = 0; t < 8; ++t) {
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hb, t), one);
            w[t] = _mm256_or_si256(w[t], _mm256_slli_epi16(bit, 4));
        }
    } else if (bits == 6) {
        const __m256i three = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; ++h) {
            const __m256i hb = load(ints + 256 + 64 * h + 32 * c);
            for (int j = 0; j < 4; ++j) {
                const __m256i two = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), three);
                w[4 * h + j] = _mm256_or_si256(w[4 * h + j], _mm256_slli_epi16(two, 4));
            }
        }
    }
}

inline __m256 f16x8(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 u8x8(const uint8_t* p, bool is_signed) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// The low (or high) nibbles of 8 bytes as floats (Q2_K's scales and minimums).
inline __m256 nib8(const uint8_t* p, bool high) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if (high) b = _mm_srli_epi16(b, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
}

// dot += the 4-byte dot products of quads t0..t1 of w against the row's quads.
// `group` quads' maddubs results are summed in int16 before one madd: exact while group x 2 x
// u's largest x 127 stays within int16 (group_of), so the integers are the reference's.
template <int group>
WEIR_INLINE __m256i dots(const __m256i* w, const __m256i* sign, const int8_t* xq, int t0, int t1,
                         bool signed_w, __m256i dot) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = t0; t < t1; t += group) {
        const __m256i x = bcast4(xq + 4 * t);
        __m256i p = _mm256_maddubs_epi16(w[t], signed_w ? _mm256_sign_epi8(x, sign[t]) : x);
        for (int g = t + 1; g < t + group; ++g)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g], bcast4(xq + 4 * g)));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
    }
    return dot;
}

// Quads whose products an int16 lane holds: |x| <= 127, u <= 2^bits - 1 (a signed 8-bit
// weight, |q| <= 128: one), four at most (a half of Q6_K's kind is four quads).
constexpr int group_of(int bits, bool signed_w) {
    return signed_w ? 1 : std::min(4, 32767 / (2 * 127 * ((1 << bits) - 1)));
}

// The sum of 16 int8 activations (the sum of each + 128, less 16 x 128).
inline int32_t half_sum(const int8_t* x) {
    const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)), _mm_set1_epi8(char(0x80)));
    const __m128i s = _mm_sad_epu8(v, _mm_setzero_si128());
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

inline __m256 update(__m256 acc, __m256i dot, __m256 alpha, __m256 beta, float dx, float xs) {
    const __m256 ad = _mm256_mul_ps(alpha, _mm256_set1_ps(dx));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ad, acc);
    return _mm256_fnmadd_ps(beta, _mm256_set1_ps(xs), acc);
}

// Sums kept in memory (L1) per row, [row][chain][8 columns]: AVX2's 16 registers hold one
// half panel's decoded block, not the rows' sums as well.
template <int format>
void blocks(const uint8_t* panel, const Acts& a, int64_t rows, float* out) {
    const Geometry g = geometry(format);
    const int64_t nb = a.k / 32;
    constexpr bool q8 = format == kWQ8_0 || is_iq(format);  // signed: |q| against sign(x, q)
    constexpr int group = group_of(geometry(format).bits, q8);
    alignas(32) float e[kRowChunk][2][2][8];  // [row][half c][b % 2][column]
    std::memset(e, 0, sizeof(float) * rows * 32);
    const uint8_t* at = panel;
    const uint8_t* header = nullptr;
    __m256i w[8], sign[8] = {};
    for (int64_t b = 0; b < nb; ++b) {
        if (g.header && b % 8 == 0) {
            header = at;
            at += g.header;
        }
        const uint8_t* scales = at;
        const uint8_t* ints = at + g.scales;
        at += g.scales + g.ints;
        for (int c = 0; c < 2; ++c) {
            __m256 alpha[2], beta[2];
            if (is_d_only(format)) {
                alpha[0] = f16x8(scales + 16 * c);
                beta[0] = _mm256_mul_ps(_mm256_set1_ps(zero_u(format)), alpha[0]);
            } else if (is_d_m(format)) {
                alpha[0] = f16x8(scales + 16 * c);
                beta[0] = _mm256_sub_ps(_mm256_setzero_ps(), f16x8(scales + 32 + 16 * c));
            } else if (is_sc16(format)) {
                const __m256 d = f16x8(header + 16 * c);
                for (int h = 0; h < 2; ++h) {
                    alpha[h] = _mm256_mul_ps(d, u8x8(scales + 16 * h + 8 * c, true));
                    if constexpr (scale_unit(format) != 1.f)
                        alpha[h] = _mm256_mul_ps(alpha[h], _mm256_set1_ps(scale_unit(format)));
                    beta[h] = _mm256_mul_ps(_mm256_set1_ps(sc16_zero(format)), alpha[h]);
                }
            } else if (is_xs(format)) {
                alpha[0] = _mm256_mul_ps(f16x8(header + 16 * c), u8x8(scales + 8 * c, true));
                if constexpr (scale_unit(format) != 1.f)
                    alpha[0] = _mm256_mul_ps(alpha[0], _mm256_set1_ps(scale_unit(format)));
                beta[0] = _mm256_mul_ps(_mm256_set1_ps(128.f), alpha[0]);
            } else if (format == kWQ2_K) {
                const __m256 d = f16x8(header + 16 * c), dmin = f16x8(header + 32 + 16 * c);
                for (int h = 0; h < 2; ++h) {
                    alpha[h] = _mm256_mul_ps(d, nib8(scales + 16 * h + 8 * c, false));
                    beta[h] = _mm256_mul_ps(dmin, nib8(scales + 16 * h + 8 * c, true));
                }
            } else {
                alpha[0] = _mm256_mul_ps(f16x8(header + 16 * c), u8x8(scales + 8 * c, false));
                beta[0] = _mm256_mul_ps(f16x8(header + 32 + 16 * c), u8x8(scales + 16 + 8 * c, false));
            }
            decode<format>(ints, c, w, sign);
            for (int64_t r = 0; r < rows; ++r) {
                const int8_t* xq = a.xq + r * a.k + b * 32;
                const int64_t blk = r * nb + b;
                float* o = e[r][c][b % 2];
                __m256 sum = _mm256_load_ps(o);
                if (g.halves == 2) {
                    for (int h = 0; h < 2; ++h) {
                        // signed table values (IQ2_XS, IQ2_S): sum x u = sum x q + 128 sum x
                        const __m256i start = _mm256_set1_epi32(q8 ? 128 * half_sum(xq + 16 * h) : 0);
                        const __m256i dot = dots<group>(w, sign, xq, 4 * h, 4 * h + 4, q8, start);
                        sum = update(sum, dot, alpha[h], beta[h], a.dx[blk], a.xs16[2 * blk + h]);
                    }
                } else {
                    // Q8_0: sum x u = sum x q + 128 sum x
                    const __m256i start = _mm256_set1_epi32(q8 ? 128 * a.s[blk] : 0);
                    const __m256i dot = dots<group>(w, sign, xq, 0, 8, q8, start);
                    sum = update(sum, dot, alpha[0], beta[0], a.dx[blk], a.xs[blk]);
                }
                _mm256_store_ps(o, sum);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < 2; ++c)
            _mm256_storeu_ps(out + r * kPanel + 8 * c,
                             _mm256_add_ps(_mm256_load_ps(e[r][c][0]), _mm256_load_ps(e[r][c][1])));
}

// Columns of a 16-bit half panel as (even k, odd k) floats: w holds 8 columns' pairs.
inline void bf16_pairs(const uint8_t* p, __m256& w0, __m256& w1) {
    const __m256i v = load(p);
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
}

inline void f16_pairs(const uint8_t* p, __m256& w0, __m256& w1) {
    const __m256 lo = f16x8(p), hi = f16x8(p + 16);  // columns 0..3, 4..7, each (even, odd)
    const __m256 e = _mm256_shuffle_ps(lo, hi, 0x88), o = _mm256_shuffle_ps(lo, hi, 0xDD);
    w0 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
    w1 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8));
}

// ---- 16-bit formats: R rows (1 or 2) over both half panels in registers, pair p of k into
// sum p % 2 (the reference's two chains); 2 chains x R rows x 2 halves sums, the pair's four
// weight registers and x's two fill AVX2's sixteen. Format and rows are template arguments so
// that nothing is decided, and no sum stored, inside the loop over k. x is float32 for both
// formats: BF16's activations come rounded to bf16 as floats (quant.cpp products() makes them
// once), so that a row's pair is two broadcasts from memory.

// Pair p of the panel into chain e (e[r][c]: row r's sum over half c).
template <bool BF, int R>
WEIR_INLINE void pair(const uint8_t* panel, int64_t p, const void* x, int64_t stride, int64_t r0,
                      __m256 (&e)[R][2]) {
    __m256 w[2][2];  // [half c][even, odd k]
    for (int c = 0; c < 2; ++c) {
        if constexpr (BF) bf16_pairs(panel + 64 * p + 32 * c, w[c][0], w[c][1]);
        else f16_pairs(panel + 64 * p + 32 * c, w[c][0], w[c][1]);
    }
    for (int r = 0; r < R; ++r) {
        const float* xr = static_cast<const float*>(x) + (r0 + r) * stride + 2 * p;
        const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
        for (int c = 0; c < 2; ++c) {
            e[r][c] = _mm256_fmadd_ps(x1, w[c][1], e[r][c]);
            e[r][c] = _mm256_fmadd_ps(x0, w[c][0], e[r][c]);
        }
    }
}

template <bool BF, int R>
void halves(const uint8_t* panel, int64_t k, const void* x, int64_t stride, int64_t r0,
            float* out) {
    __m256 e0[R][2], e1[R][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c) e0[r][c] = e1[r][c] = _mm256_setzero_ps();
    const int64_t pairs = k / 2;
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) {
        pair<BF, R>(panel, p, x, stride, r0, e0);
        pair<BF, R>(panel, p + 1, x, stride, r0, e1);
    }
    if (p < pairs) pair<BF, R>(panel, p, x, stride, r0, e0);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c)
            _mm256_storeu_ps(out + (r0 + r) * kPanel + 8 * c, _mm256_add_ps(e0[r][c], e1[r][c]));
}

template <bool BF>
void halves_rows(const uint8_t* panel, int64_t k, const void* x, int64_t stride, int64_t rows,
                 float* out) {
    int64_t r0 = 0;
    for (; r0 + 2 <= rows; r0 += 2) halves<BF, 2>(panel, k, x, stride, r0, out);
    if (r0 < rows) halves<BF, 1>(panel, k, x, stride, r0, out);
}

}  // namespace

void panel_avx2(int format, const uint8_t* panel, const Acts& a, const void* x16,
                int64_t x16_stride, int64_t rows, float* out) {
    if (format == kWBF16) return halves_rows<true>(panel, a.k, x16, x16_stride, rows, out);
    if (format == kWF16) return halves_rows<false>(panel, a.k, x16, x16_stride, rows, out);
    with_block_format(format, [&](auto f) { blocks<decltype(f)::value>(panel, a, rows, out); });
}

}  // namespace weir::q

#endif
