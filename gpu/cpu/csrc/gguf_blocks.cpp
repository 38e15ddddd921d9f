// GGUF's block formats read block by block (gguf_blocks.h).

#include "gguf_blocks.h"

#include "quant_layout.h"
#include "weir.h"

namespace weir::q {

void parse_block(int format, const uint8_t* b, Parsed& p) {
    switch (format) {
        case kWQ8_0:
            p.d16 = load16(b);
            for (int i = 0; i < 32; ++i) p.u[i] = uint8_t(int8_t(b[2 + i]) + 128);
            return;
        case kWQ4_0:
        case kWQ4_1:
        case kWQ5_0:
        case kWQ5_1: {
            p.d16 = load16(b);
            const uint8_t* at = b + 2;
            if (is_d_m(format)) {
                p.dmin16 = load16(at);  // m
                at += 2;
            }
            uint32_t qh = 0;  // Q5_0/Q5_1: bit i is weight i's fifth bit
            if (geometry(format).bits == 5) {
                std::memcpy(&qh, at, 4);
                at += 4;
            }
            for (int i = 0; i < 16; ++i) {
                p.u[i] = (at[i] & 0x0F) | (((qh >> i) & 1) << 4);
                p.u[16 + i] = (at[i] >> 4) | (((qh >> (16 + i)) & 1) << 4);
            }
            return;
        }
        case kWQ4_K:
        case kWQ5_K: {
            p.d16 = load16(b);
            p.dmin16 = load16(b + 2);
            const uint8_t* s = b + 4;
            for (int j = 0; j < 4; ++j) {
                p.sc[j] = s[j] & 63;
                p.mn[j] = s[4 + j] & 63;
                p.sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 6) << 4);
                p.mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
            }
            const uint8_t* qh = format == kWQ5_K ? b + 16 : nullptr;
            const uint8_t* qs = format == kWQ5_K ? b + 48 : b + 16;
            for (int c = 0; c < 4; ++c)
                for (int l = 0; l < 32; ++l) {
                    const uint8_t v = qs[32 * c + l];
                    p.u[64 * c + l] = v & 0x0F;
                    p.u[64 * c + 32 + l] = v >> 4;
                }
            if (qh)
                for (int s2 = 0; s2 < 8; ++s2)
                    for (int l = 0; l < 32; ++l)
                        p.u[32 * s2 + l] |= ((qh[l] >> s2) & 1) << 4;
            return;
        }
        case kWIQ4_NL:
        case kWMXFP4:  // transcoded (gpu/quant/mxfp4.py): f16 d, then the file's 16 bytes
            p.d16 = load16(b);
            for (int i = 0; i < 16; ++i) {
                p.u[i] = b[2 + i] & 0x0F;  // indices: their values in read_column
                p.u[16 + i] = b[2 + i] >> 4;
            }
            return;
        case kWIQ2_XS:  // transcoded (gpu/quant/iq_grids.py): f16 d, 16 int8 scales, indices
        case kWIQ2_S:
            p.d16 = load16(b);
            std::memcpy(p.sc, b + 2, 16);
            for (int s = 0; s < 8; ++s)
                for (int j = 0; j < 16; ++j) {
                    p.u[32 * s + j] = b[18 + 16 * s + j] & 0x0F;
                    p.u[32 * s + 16 + j] = b[18 + 16 * s + j] >> 4;
                }
            return;
        case kWIQ4_XS:
        case kWIQ3_XXS:  // transcoded into IQ4_XS's bytes (gpu/quant/iq_grids.py)
        case kWIQ3_S:
        case kWIQ2_XXS: {
            p.d16 = load16(b);
            const uint16_t high = load16(b + 2);
            for (int s = 0; s < 8; ++s) {
                const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | (((high >> (2 * s)) & 3) << 4);
                p.sc[s] = uint8_t(ls - 32);
                for (int j = 0; j < 16; ++j) {
                    p.u[32 * s + j] = b[8 + 16 * s + j] & 0x0F;
                    p.u[32 * s + 16 + j] = b[8 + 16 * s + j] >> 4;
                }
            }
            return;
        }
        case kWQ2_K: {
            for (int s = 0; s < 16; ++s) {
                p.sc[s] = b[s] & 0x0F;
                p.mn[s] = b[s] >> 4;
            }
            p.d16 = load16(b + 80);
            p.dmin16 = load16(b + 82);
            const uint8_t* qs = b + 16;
            for (int e = 0; e < 256; ++e) {  // 128-weight half c, 32-weight part j, l in it
                const int c = e / 128, j = (e % 128) / 32, l = e % 32;
                p.u[e] = (qs[32 * c + l] >> (2 * j)) & 3;
            }
            return;
        }
        case kWQ3_K: {
            // ggml's 12 bytes of sixteen 6-bit scales, unpacked as dequantize_row_q3_K does
            const uint8_t* raw = b + 96;
            for (int j = 0; j < 4; ++j) {
                const uint8_t hi = raw[8 + j];
                p.sc[j] = uint8_t(((raw[j] & 0x0F) | ((hi & 3) << 4)) - 32);
                p.sc[4 + j] = uint8_t(((raw[4 + j] & 0x0F) | (((hi >> 2) & 3) << 4)) - 32);
                p.sc[8 + j] = uint8_t(((raw[j] >> 4) | (((hi >> 4) & 3) << 4)) - 32);
                p.sc[12 + j] = uint8_t(((raw[4 + j] >> 4) | (((hi >> 6) & 3) << 4)) - 32);
            }
            p.d16 = load16(b + 108);
            const uint8_t* hmask = b;
            const uint8_t* qs = b + 32;
            for (int e = 0; e < 256; ++e) {  // 128-weight half c, 32-weight part j, l in it
                const int c = e / 128, j = (e % 128) / 32, l = e % 32;
                const int low = (qs[32 * c + l] >> (2 * j)) & 3;
                const int high = (hmask[l] >> (4 * c + j)) & 1;
                p.u[e] = uint8_t(low | (high << 2));
            }
            return;
        }
        case kWQ6_K: {
            const uint8_t* ql = b;
            const uint8_t* qh = b + 128;
            std::memcpy(p.sc, b + 192, 16);
            p.d16 = load16(b + 208);
            for (int h = 0; h < 2; ++h)
                for (int t = 0; t < 4; ++t)
                    for (int j = 0; j < 32; ++j) {
                        const uint8_t lo = ql[64 * h + 32 * (t % 2) + j];
                        const uint8_t nib = t < 2 ? (lo & 0x0F) : (lo >> 4);
                        const uint8_t hi = (qh[32 * h + j] >> (2 * t)) & 3;
                        p.u[128 * h + 32 * t + j] = nib | (hi << 4);
                    }
            return;
        }
    }
}

}  // namespace weir::q
