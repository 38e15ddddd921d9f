// weir's packed layout of a weight in a block or 16-bit format, and the quantized activations,
// shared by the paths of quant.cpp (reference), quant_avx2.cpp and quant_avx512.cpp. Header-only,
// no torch; every path computes the same integers and the same float operations in the same
// order (update() below), so a path's results are the reference's.
//
// A weight [n, k] is ceil(n / 16) panels of 16 output columns (zero columns pad the last), each
// panel's bytes in k order.
//
// Block formats, per 32 weights of k ("a block"), every column's part side by side:
//   k-quants, before each 256 (8 blocks): a header, per column f16 d (and for Q2_K/Q4_K/Q5_K f16
//           dmin)
//   scales: Q8_0/Q4_0/Q5_0 f16 d per column; Q4_1/Q5_1 f16 d [16] then f16 m [16]; Q4_K/Q5_K
//           u8 sc[16] then u8 m[16]; Q6_K and Q3_K int8 sc of the block's first 16 weights [16],
//           then of its second 16 [16] (Q3_K's as the signed sc - 32); Q2_K a byte sc | m << 4
//           of the first 16 [16], then of the second [16] (as its file holds them)
//   IQ4_NL (and MXFP4, transcoded at load: gpu/quant/mxfp4.py) f16 d per column; IQ4_XS int8 ls (its 6-bit scale less 32) per column, d in the header
//   (IQ3_XXS and IQ3_S as IQ4_XS: gpu/quant/iq_grids.py transcodes their grids into its layout, ls the
//   odd 1..31 of their scales)
//   integers, each an unsigned value u (Q8_0: q + 128 in 0..255; Q2_K: 0..3; Q3_K: 0..7; Q4_0,
//   Q4_1, Q4_K: 0..15; Q5_0, Q5_1, Q5_K: 0..31; Q6_K: 0..63) laid out for a dot product that
//   takes 4 consecutive k of a column per 32-bit lane ("quad" t: k = 4t..4t+3, t = 0..7):
//     8-bit: [t 0..7][column 16][4 bytes]
//     4-bit: [t 0..3][column 16][4 bytes], low nibble quad t, high nibble quad t + 4 (IQ4_NL,
//           IQ4_XS, IQ3_XXS, IQ3_S, MXFP4: the index i of the weight's value in its format's table of
//           sixteen, u = iq_u(format)[i], the value + 128)
//     5-bit: the 4-bit part of u as above, then [column 16][4 bytes] whose bit t is u's bit 4 in
//           quad t
//     2-bit: [p 0..1][column 16][4 bytes] whose bits 2j, 2j + 1 are u's bits 0, 1 in quad
//           p + 2j
//     3-bit: the 2-bit part of u as above, then [column 16][4 bytes] whose bit t is u's bit 2
//           in quad t
//     Q6_K: the 4-bit part, then two [column 16][4 bytes] regions h = 0, 1 whose bits 2j, 2j + 1
//           are u's bits 4, 5 in quad 4h + j
// Weight value: Q8_0 d (u - 128); Q4_0 d (u - 8); Q5_0 d (u - 16); Q4_1/Q5_1 d u + m;
// IQ4_NL (MXFP4) d (u - 128); IQ4_XS (IQ3_S) d ls (u - 128), IQ3_XXS d ls (u - 128) / 4; Q4_K/Q5_K d sc u - dmin m (Q2_K the same per 16); Q6_K d sc (u - 32), Q3_K d sc (u - 4) with
// sc the scale of the weight's 16. So a
// block's sum over k of x w is
//   dx (alpha A - beta S)
// per column, with x = dx xq (xq int8, per 32 weights of a row of x), A = sum xq u and
// S = sum xq: alpha = d, beta = 128 d (Q8_0), 8 d (Q4_0), 16 d (Q5_0) or -m (Q4_1, Q5_1);
// alpha = d sc, beta = dmin m (Q4_K, Q5_K; Q2_K per half); for Q6_K and Q3_K the same per half
// with alpha = d sc, beta = 32 d sc or 4 d sc.
//
// 16-bit formats: [k / 2][column 16][2 elements]: each 32-bit lane one column's two weights of k.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "weir.h"

namespace weir::q {

struct Geometry {
    int64_t header;  // bytes before each 256 weights of k (k-quants), per panel
    int64_t scales;  // bytes of scales per block, per panel
    int64_t ints;    // bytes of integers per block, per panel
    int bits;        // bits of u
    int halves;      // 2: scales per 16 weights (Q6_K); 1: per 32
    int block;       // GGUF's block: 32 or 256 weights
    int block_bytes;  // GGUF's bytes per block
};

constexpr Geometry geometry(int format) {
    switch (format) {
        case kWQ8_0: return {0, 32, 512, 8, 1, 32, 34};
        case kWQ4_0: return {0, 32, 256, 4, 1, 32, 18};
        case kWQ4_1: return {0, 64, 256, 4, 1, 32, 20};
        case kWQ5_0: return {0, 32, 320, 5, 1, 32, 22};
        case kWQ5_1: return {0, 64, 320, 5, 1, 32, 24};
        case kWQ2_K: return {64, 32, 128, 2, 2, 256, 84};
        case kWQ3_K: return {32, 32, 192, 3, 2, 256, 110};
        case kWQ4_K: return {64, 32, 256, 4, 1, 256, 144};
        case kWQ5_K: return {64, 32, 320, 5, 1, 256, 176};
        case kWQ6_K: return {32, 32, 384, 6, 2, 256, 210};
        case kWIQ4_NL:
        case kWMXFP4: return {0, 32, 256, 4, 1, 32, 18};  // MXFP4: the transcoded block's bytes
        case kWIQ4_XS:
        case kWIQ3_XXS:
        case kWIQ3_S:
        case kWIQ2_XXS: return {32, 16, 256, 4, 1, 256, 136};  // IQ3, IQ2: the transcoded block's
        case kWIQ2_XS:
        case kWIQ2_S: return {32, 32, 256, 4, 2, 256, 146};   // bytes (gpu/quant/iq_grids.py)
        default: return {0, 0, 0, 0, 0, 0, 0};
    }
}

constexpr bool is_block(int format) { return geometry(format).bits != 0; }

// fn(std::integral_constant<int, F>{}) for block format F (nothing for any other): the one list
// of block formats each fast path instantiates its per-format pass from.
template <typename Fn>
inline void with_block_format(int format, Fn&& fn) {
    switch (format) {
        case kWQ8_0: return fn(std::integral_constant<int, kWQ8_0>{});
        case kWQ4_0: return fn(std::integral_constant<int, kWQ4_0>{});
        case kWQ4_1: return fn(std::integral_constant<int, kWQ4_1>{});
        case kWQ5_0: return fn(std::integral_constant<int, kWQ5_0>{});
        case kWQ5_1: return fn(std::integral_constant<int, kWQ5_1>{});
        case kWQ2_K: return fn(std::integral_constant<int, kWQ2_K>{});
        case kWQ3_K: return fn(std::integral_constant<int, kWQ3_K>{});
        case kWQ4_K: return fn(std::integral_constant<int, kWQ4_K>{});
        case kWQ5_K: return fn(std::integral_constant<int, kWQ5_K>{});
        case kWQ6_K: return fn(std::integral_constant<int, kWQ6_K>{});
        case kWIQ4_NL: return fn(std::integral_constant<int, kWIQ4_NL>{});
        case kWMXFP4: return fn(std::integral_constant<int, kWMXFP4>{});
        case kWIQ4_XS: return fn(std::integral_constant<int, kWIQ4_XS>{});
        case kWIQ3_XXS: return fn(std::integral_constant<int, kWIQ3_XXS>{});
        case kWIQ3_S: return fn(std::integral_constant<int, kWIQ3_S>{});
        case kWIQ2_XXS: return fn(std::integral_constant<int, kWIQ2_XXS>{});
        case kWIQ2_XS: return fn(std::integral_constant<int, kWIQ2_XS>{});
        case kWIQ2_S: return fn(std::integral_constant<int, kWIQ2_S>{});
        default: return;
    }
}
constexpr bool is_half(int format) { return format == kWF16 || format == kWBF16; }

// The sixteen values of the table formats' indices, ascending (MXFP4's, below, in code order):
// IQ4_NL's and IQ4_XS's (llama.cpp's kvalues_iq4nl); IQ3_XXS's grid magnitudes 4..62, signed (its
// scale's quarter: scale_unit); IQ3_S's odd 1..15, signed.
alignas(16) constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) constexpr int8_t kIq3XxsValues[16] = {-62, -52, -44, -36, -28, -20, -12, -4,
                                                  4,   12,  20,  28,  36,  44,  52, 62};
alignas(16) constexpr int8_t kIq3SValues[16] = {-15, -13, -11, -9, -7, -5, -3, -1,
                                                1,   3,   5,   7,  9,  11, 13, 15};
// MXFP4's (E2M1's sixteen codes doubled, in code order: llama.cpp's kvalues_mxfp4).
alignas(16) constexpr int8_t kMxfp4Values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};
// IQ2_XXS's, IQ2_XS's and IQ2_S's grid magnitudes 8, 25, 43, signed (indices 6..15 unused).
alignas(16) constexpr int8_t kIq2Values[16] = {-43, -25, -8, 8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
constexpr bool is_iq2(int format) {
    return format == kWIQ2_XXS || format == kWIQ2_XS || format == kWIQ2_S;
}
constexpr const int8_t* iq_values(int format) {
    return format == kWIQ3_XXS ? kIq3XxsValues
           : format == kWIQ3_S ? kIq3SValues
           : is_iq2(format)    ? kIq2Values
           : format == kWMXFP4 ? kMxfp4Values
                               : kIq4Values;
}
// Each table's u (value + 128).
alignas(16) constexpr uint8_t kIq4U[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                           129, 141, 153, 166, 181, 197, 217, 241};
alignas(16) constexpr uint8_t kIq3XxsU[16] = {66,  76,  84,  92,  100, 108, 116, 124,
                                              132, 140, 148, 156, 164, 172, 180, 190};
alignas(16) constexpr uint8_t kIq3SU[16] = {113, 115, 117, 119, 121, 123, 125, 127,
                                            129, 131, 133, 135, 137, 139, 141, 143};
alignas(16) constexpr uint8_t kMxfp4U[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                             128, 127, 126, 125, 124, 122, 120, 116};
alignas(16) constexpr uint8_t kIq2U[16] = {85,  103, 120, 136, 153, 171, 128, 128,
                                           128, 128, 128, 128, 128, 128, 128, 128};
constexpr const uint8_t* iq_u(int format) {
    return format == kWIQ3_XXS ? kIq3XxsU
           : format == kWIQ3_S ? kIq3SU
           : is_iq2(format)    ? kIq2U
           : format == kWMXFP4 ? kMxfp4U
                               : kIq4U;
}
constexpr bool u_tables_agree() {
    for (int f : {kWIQ4_NL, kWIQ3_XXS, kWIQ3_S, kWIQ2_XXS, kWMXFP4})
        for (int i = 0; i < 16; ++i)
            if (iq_u(f)[i] != iq_values(f)[i] + 128) return false;
    return true;
}
static_assert(u_tables_agree(), "a table's u is its value + 128");
// Formats whose 4-bit integers index a table of sixteen values.
constexpr bool is_iq(int format) {
    return format == kWIQ4_NL || format == kWIQ4_XS || format == kWIQ3_XXS || format == kWIQ3_S ||
           is_iq2(format) || format == kWMXFP4;
}
// IQ4_XS's layout: f16 d per 256 in the header, an int8 scale per 32.
constexpr bool is_xs(int format) {
    return format == kWIQ4_XS || format == kWIQ3_XXS || format == kWIQ3_S || format == kWIQ2_XXS;
}
// The factor of d sc in a weight of the table formats: IQ3_XXS's d (2 ls + 1) / 4, the IQ2s'
// d (2 ls + 1) / 8 (every product exact).
constexpr float scale_unit(int format) {
    return format == kWIQ3_XXS ? 0.25f : is_iq2(format) ? 0.125f : 1.f;
}

// Formats whose blocks carry one f16 d (beta = offset d: the u of a zero weight) or d and m.
constexpr bool is_d_only(int format) {
    return format == kWQ8_0 || format == kWQ4_0 || format == kWQ5_0 || format == kWIQ4_NL ||
           format == kWMXFP4;
}
constexpr bool is_d_m(int format) { return format == kWQ4_1 || format == kWQ5_1; }
constexpr float zero_u(int format) {
    return format == kWQ8_0 || format == kWIQ4_NL || format == kWMXFP4 ? 128.f : format == kWQ5_0 ? 16.f : 8.f;
}
// k-quants whose header holds dmin after d.
constexpr bool has_dmin(int format) {
    return format == kWQ2_K || format == kWQ4_K || format == kWQ5_K;
}
// k-quants with int8 scales per 16 weights and a header of d alone; their u of a zero weight.
constexpr bool is_sc16(int format) {
    return format == kWQ6_K || format == kWQ3_K || format == kWIQ2_XS || format == kWIQ2_S;
}
constexpr float sc16_zero(int format) {
    return format == kWQ6_K ? 32.f : format == kWQ3_K ? 4.f : 128.f;
}

// Bytes of one panel for k weights of k.
inline int64_t panel_bytes(int format, int64_t k) {
    if (is_half(format)) return k * kPanel * 2;
    const Geometry g = geometry(format);
    return k / 32 * (g.scales + g.ints) + k / 256 * g.header;
}

inline float half_to_float(uint16_t h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return float(v);
}

inline float bf16_to_float(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch does (the activations of a bf16 product).
inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Rows of x, quantized for block formats: xq [rows][k] int8; per 32 weights of a row dx (x =
// dx xq), s = sum(xq), xs = dx * s; per 16, xs16 = dx * sum of those 16 xq.
struct Acts {
    const int8_t* xq;
    const float* dx;
    const int32_t* s;
    const float* xs;
    const float* xs16;
    int64_t k;
};

// The float part of one block's contribution, the same in every path: ad = alpha dx;
// e = fma(A, ad, e); e = fma(-beta, xs, e). Each output keeps two such sums, block b adding to
// e[b % 2] (Q6_K: its first half, then its second), and is e[0] + e[1]: two chains of float
// operations a core can run side by side, in one order every path and every batch size shares.
inline float update(float e, int32_t a, float alpha, float beta, float dx, float xs) {
    const float ad = alpha * dx;
    e = std::fma(float(a), ad, e);
    return std::fma(-beta, xs, e);
}

// A block of a panel decoded (quant_pack.cpp read_block): the reference's view of the weights.
struct BlockView {
    uint8_t u[kPanel][32];
    float alpha[kPanel][2], beta[kPanel][2];  // per half (equal halves unless Q6_K)
};
void read_block(int format, const uint8_t* header, const uint8_t* scales, const uint8_t* ints,
                BlockView& v);
// One column of it: u[32], and alpha, beta per half.
void read_column(int format, const uint8_t* header, const uint8_t* scales, const uint8_t* ints,
                 int col, uint8_t u[32], float alpha[2], float beta[2]);

// A product takes up to this many rows of x per pass over a panel (wgemm's chunk).
constexpr int64_t kRowChunk = 64;

// 16-bit formats: each output keeps two sums, pair p of k (k = 2p, 2p + 1) adding to e[p % 2]
// fma(x[2p + 1], w[2p + 1], .) then fma(x[2p], w[2p], .) (AVX-512 BF16's pair order), and is
// e[0] + e[1]. Two chains a row: the AVX-512 path holds 8 rows of a panel (16 sums) in
// registers, so a panel read from memory serves 8 rows a pass.
constexpr int kHalfSums = 2;

// One panel's product over rows [0, rows) of `acts` (block formats) or of bf16/f32 x rows
// (16-bit formats): out[rows][kPanel] gets the sums. One per path.
using PanelFn = void (*)(int format, const uint8_t* panel, const Acts& acts, const void* x16,
                         int64_t x16_stride, int64_t rows, float* out);

void panel_ref(int format, const uint8_t* panel, const Acts& acts, const void* x16,
               int64_t x16_stride, int64_t rows, float* out);
void panel_avx2(int format, const uint8_t* panel, const Acts& acts, const void* x16,
                int64_t x16_stride, int64_t rows, float* out);
void panel_avx512(int format, const uint8_t* panel, const Acts& acts, const void* x16,
                  int64_t x16_stride, int64_t rows, float* out);

}  // namespace weir::q
