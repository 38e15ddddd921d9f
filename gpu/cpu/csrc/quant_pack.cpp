// Packing GGUF's rows of 16-bit and block-format weights into weir's panels (quant_layout.h),
// and reading a panel's blocks back out: the reference dequantization (wdequant, exactly the
// `gguf` package's) and the reference product's view of a block (quant.cpp panel_ref).

#include <algorithm>
#include <cstring>

#include "gguf_blocks.h"
#include "quant_layout.h"
#include "weir.h"

namespace weir {

using namespace q;

namespace {

// One column's block (32 weights of k, values u[0..31]) into the panel's integer layout.
void put_ints(int bits, const uint8_t* u, int col, uint8_t* ints) {
    if (bits == 8) {
        for (int t = 0; t < 8; ++t)
            for (int i = 0; i < 4; ++i) ints[(t * kPanel + col) * 4 + i] = u[4 * t + i];
        return;
    }
    if (bits <= 3) {
        for (int p = 0; p < 2; ++p)
            for (int i = 0; i < 4; ++i) {
                uint8_t v = 0;
                for (int j = 0; j < 4; ++j) v |= (u[4 * (p + 2 * j) + i] & 3) << (2 * j);
                ints[(p * kPanel + col) * 4 + i] = v;
            }
        if (bits == 2) return;
        for (int i = 0; i < 4; ++i) {
            uint8_t v = 0;
            for (int t = 0; t < 8; ++t) v |= ((u[4 * t + i] >> 2) & 1) << t;
            ints[128 + col * 4 + i] = v;
        }
        return;
    }
    for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 4; ++i)
            ints[(t * kPanel + col) * 4 + i] = (u[4 * t + i] & 0x0F) | ((u[16 + 4 * t + i] & 0x0F) << 4);
    uint8_t* hb = ints + 256;
    if (bits == 5) {
        for (int i = 0; i < 4; ++i) {
            uint8_t v = 0;
            for (int t = 0; t < 8; ++t) v |= ((u[4 * t + i] >> 4) & 1) << t;
            hb[col * 4 + i] = v;
        }
    } else if (bits == 6) {
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < 4; ++i) {
                uint8_t v = 0;
                for (int j = 0; j < 4; ++j) v |= ((u[4 * (4 * h + j) + i] >> 4) & 3) << (2 * j);
                hb[64 * h + col * 4 + i] = v;
            }
    }
}

void pack_block_panel(int format, const uint8_t* rows, int64_t row_bytes, int64_t n, int64_t k,
                      int64_t panel, uint8_t* out) {
    const Geometry g = geometry(format);
    const int64_t blocks = k / 32;
    Parsed p;
    uint8_t* w = out;
    for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* header = nullptr;
        if (g.header && b % 8 == 0) {
            header = w;
            std::memset(header, 0, g.header);
            w += g.header;
        }
        uint8_t* scales = w;
        uint8_t* ints = w + g.scales;
        std::memset(w, 0, g.scales + g.ints);
        w += g.scales + g.ints;
        for (int col = 0; col < kPanel; ++col) {
            const int64_t row = panel * kPanel + col;
            if (row >= n) break;  // zero weights: scales and integers 0 (Q8_0's u 0: scale 0)
            const int64_t gb = b * 32 / g.block;  // the GGUF block holding these 32
            parse_block(format, rows + row * row_bytes + gb * g.block_bytes, p);
            const int64_t off = (b * 32) % g.block;  // where they start in it
            put_ints(g.bits, p.u + off, col, ints);
            const int64_t sub = off / 32;
            if (is_d_only(format)) {
                std::memcpy(scales + 2 * col, &p.d16, 2);
            } else if (is_d_m(format)) {
                std::memcpy(scales + 2 * col, &p.d16, 2);
                std::memcpy(scales + 2 * (kPanel + col), &p.dmin16, 2);
            } else if (format == kWQ2_K) {
                for (int h = 0; h < 2; ++h)
                    scales[h * kPanel + col] = uint8_t(p.sc[2 * sub + h] | (p.mn[2 * sub + h] << 4));
                if (header) {
                    std::memcpy(header + 2 * col, &p.d16, 2);
                    std::memcpy(header + 2 * (kPanel + col), &p.dmin16, 2);
                }
            } else if (is_xs(format)) {
                scales[col] = p.sc[sub];
                if (header) std::memcpy(header + 2 * col, &p.d16, 2);
            } else if (is_sc16(format)) {
                scales[col] = p.sc[2 * sub];
                scales[kPanel + col] = p.sc[2 * sub + 1];
                if (header) std::memcpy(header + 2 * col, &p.d16, 2);
            } else {
                scales[col] = p.sc[sub];
                scales[kPanel + col] = p.mn[sub];
                if (header) {
                    std::memcpy(header + 2 * col, &p.d16, 2);
                    std::memcpy(header + 2 * (kPanel + col), &p.dmin16, 2);
                }
            }
        }
    }
}

void pack_half_panel(const uint8_t* rows, int64_t n, int64_t k, int64_t panel, uint8_t* out) {
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    std::memset(out, 0, panel_bytes(kWBF16, k));
    for (int col = 0; col < kPanel; ++col) {
        const int64_t row = panel * kPanel + col;
        if (row >= n) break;
        const uint16_t* src = reinterpret_cast<const uint16_t*>(rows + row * k * 2);
        for (int64_t kk = 0; kk < k; ++kk) o[(kk / 2 * kPanel + col) * 2 + kk % 2] = src[kk];
    }
}

}  // namespace

namespace q {

void read_column(int format, const uint8_t* header, const uint8_t* scales, const uint8_t* ints,
                 int col, uint8_t u[32], float alpha[2], float beta[2]) {
    const Geometry g = geometry(format);
    for (int kk = 0; kk < 32; ++kk) {
        const int t = kk / 4, i = kk % 4;
        if (g.bits == 8) {
            u[kk] = ints[(t * kPanel + col) * 4 + i];
            continue;
        }
        if (g.bits <= 3) {
            const uint8_t low = ints[((t % 2) * kPanel + col) * 4 + i] >> (2 * (t / 2));
            u[kk] = low & 3;
            if (g.bits == 3) u[kk] |= ((ints[128 + col * 4 + i] >> t) & 1) << 2;
            continue;
        }
        const uint8_t byte = ints[((t % 4) * kPanel + col) * 4 + i];
        u[kk] = t < 4 ? (byte & 0x0F) : (byte >> 4);
        if (is_iq(format)) u[kk] = iq_u(format)[u[kk]];
        if (g.bits == 5) u[kk] |= ((ints[256 + col * 4 + i] >> t) & 1) << 4;
        if (g.bits == 6) u[kk] |= ((ints[256 + 64 * (t / 4) + col * 4 + i] >> (2 * (t % 4))) & 3) << 4;
    }
    if (is_d_only(format)) {
        const float d = half_to_float(load16(scales + 2 * col));
        alpha[0] = alpha[1] = d;
        beta[0] = beta[1] = zero_u(format) * d;
    } else if (is_d_m(format)) {
        alpha[0] = alpha[1] = half_to_float(load16(scales + 2 * col));
        beta[0] = beta[1] = -half_to_float(load16(scales + 2 * (kPanel + col)));
    } else if (is_sc16(format)) {
        const float d = half_to_float(load16(header + 2 * col));
        for (int h = 0; h < 2; ++h) {
            alpha[h] = d * float(int8_t(scales[h * kPanel + col])) * scale_unit(format);
            beta[h] = sc16_zero(format) * alpha[h];
        }
    } else if (is_xs(format)) {
        alpha[0] = alpha[1] = half_to_float(load16(header + 2 * col)) * float(int8_t(scales[col])) *
                              scale_unit(format);
        beta[0] = beta[1] = 128.f * alpha[0];
    } else if (format == kWQ2_K) {
        const float d = half_to_float(load16(header + 2 * col));
        const float dmin = half_to_float(load16(header + 2 * (kPanel + col)));
        for (int h = 0; h < 2; ++h) {
            alpha[h] = d * float(scales[h * kPanel + col] & 0x0F);
            beta[h] = dmin * float(scales[h * kPanel + col] >> 4);
        }
    } else {
        const float d = half_to_float(load16(header + 2 * col));
        const float dmin = half_to_float(load16(header + 2 * (kPanel + col)));
        alpha[0] = alpha[1] = d * float(scales[col]);
        beta[0] = beta[1] = dmin * float(scales[kPanel + col]);
    }
}

void read_block(int format, const uint8_t* header, const uint8_t* scales, const uint8_t* ints,
                BlockView& v) {
    for (int col = 0; col < kPanel; ++col)
        read_column(format, header, scales, ints, col, v.u[col], v.alpha[col], v.beta[col]);
}

}  // namespace q

namespace {

// Row `row` of the weight (output column `row` of the product) as floats, exactly as llama.cpp
// (and the gguf package) computes each weight.
void dequant_row(int format, const uint8_t* packed, int64_t k, int64_t row, float* out) {
    const uint8_t* panel = packed + row / kPanel * panel_bytes(format, k);
    const int col = int(row % kPanel);
    if (is_half(format)) {
        const uint16_t* w = reinterpret_cast<const uint16_t*>(panel);
        for (int64_t kk = 0; kk < k; ++kk) {
            const uint16_t h = w[(kk / 2 * kPanel + col) * 2 + kk % 2];
            out[kk] = format == kWBF16 ? bf16_to_float(h) : half_to_float(h);
        }
        return;
    }
    const Geometry g = geometry(format);
    const uint8_t* at = panel;
    const uint8_t* header = nullptr;
    uint8_t u[32];
    float alpha[2], beta[2];
    for (int64_t b = 0; b < k / 32; ++b) {
        if (g.header && b % 8 == 0) {
            header = at;
            at += g.header;
        }
        read_column(format, header, at, at + g.scales, col, u, alpha, beta);
        const uint8_t* scales = at;
        at += g.scales + g.ints;
        float* o = out + 32 * b;
        for (int kk = 0; kk < 32; ++kk) {
            const int h = g.halves == 2 ? kk / 16 : 0;
            if (is_d_only(format)) {
                const float d = half_to_float(load16(scales + 2 * col));
                o[kk] = d * float(int(u[kk]) - int(zero_u(format)));
            } else if (is_d_m(format)) {
                o[kk] = alpha[h] * float(u[kk]) + (-beta[h]);  // ggml: q d + m
            } else if (is_xs(format)) {
                o[kk] = alpha[h] * float(int(u[kk]) - 128);
            } else if (is_sc16(format)) {
                o[kk] = alpha[h] * float(int(u[kk]) - int(sc16_zero(format)));
            } else {
                o[kk] = alpha[h] * float(u[kk]) - beta[h];
            }
        }
    }
}

}  // namespace

bool wformat_known(int format) { return is_block(format) || is_half(format); }
int64_t wformat_row_bytes(int format, int64_t k) {
    if (is_half(format)) return 2 * k;
    const Geometry g = geometry(format);
    return k / g.block * g.block_bytes;
}

int64_t wformat_block(int format) { return is_half(format) ? 2 : geometry(format).block; }

int64_t wpacked_size(int format, int64_t n, int64_t k, bool gated) {
    return (gated ? 2 : 1) * ((n + kPanel - 1) / kPanel) * panel_bytes(format, k);
}

void wpack(int format, const uint8_t* rows, const uint8_t* rows2, int64_t n, int64_t k,
           uint8_t* packed, int64_t num_threads) {
    const int64_t panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(format, k);
    const int64_t row_bytes = wformat_row_bytes(format, k);
    const int64_t parts = rows2 ? 2 : 1;
    parallel_for(panels * parts, num_threads, [&](int64_t t) {
        const int64_t p = t / parts;
        const uint8_t* src = t % parts ? rows2 : rows;
        if (is_half(format))
            pack_half_panel(src, n, k, p, packed + t * bytes);
        else
            pack_block_panel(format, src, row_bytes, n, k, p, packed + t * bytes);
    });
}

void wdequant(int format, const uint8_t* packed, int64_t n, int64_t k, float* out) {
    for (int64_t r = 0; r < n; ++r) dequant_row(format, packed, k, r, out + r * k);
}

void wgather(int format, const uint8_t* packed, int64_t k, const int64_t* rows, int64_t count,
             float* out, int64_t num_threads) {
    parallel_for(count, count > 4 ? num_threads : 1,
                 [&](int64_t i) { dequant_row(format, packed, k, rows[i], out + i * k); });
}

}  // namespace weir
