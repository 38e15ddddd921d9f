// One GGUF block of one row of a weight, parsed into what weir's panels hold: the unsigned
// integer u of every weight and the block's scales (quant_layout.h says what u and each scale
// mean per format). Each format's bytes are read exactly as llama.cpp's dequantize_row_* (and
// the `gguf` package) read them; quant_pack.cpp lays the result out in panels.

#pragma once

#include <cstdint>
#include <cstring>

namespace weir::q {

struct Parsed {  // one GGUF block of one row
    uint8_t u[256];
    uint16_t d16, dmin16;  // f16 bits of d and dmin (Q4_1/Q5_1: m)
    uint8_t sc[16];        // Q4_K/Q5_K: 8 scales; IQ4_XS: 8 (int8); Q2_K: 16; Q3_K/Q6_K: 16 (int8)
    uint8_t mn[16];        // Q4_K/Q5_K: 8 minimums; Q2_K: 16
};

inline uint16_t load16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

void parse_block(int format, const uint8_t* b, Parsed& p);

}  // namespace weir::q
