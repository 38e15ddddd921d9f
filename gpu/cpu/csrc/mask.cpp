// Structured outputs on the CPU: -inf on every logit whose bit in the grammar's bitmask is clear.
// One row of the int32 bitmask covers the vocabulary, bit b of word w standing for token
// 32 * w + b. Words with every bit set (all 32 tokens allowed) are skipped, so a row mid-string
// (most of the vocabulary allowed) costs a scan of vocab / 32 words; a row with few allowed
// tokens writes the rest. torch's bit expansion over a large vocabulary took far longer
// (figures: docs/benchmarks.md, "Figures moved out of the code").
#include <cstdint>
#include <cstring>

#include "weir.h"

namespace weir {

void apply_token_bitmask(float* logits, int64_t row_stride, const int64_t* rows,
                         int64_t num_rows, const int32_t* mask, int64_t words, int64_t vocab,
                         int64_t num_threads) {
    // -inf by its bit pattern: the sources build with -ffast-math, under which the compiler may
    // treat an infinity constant as undefined.
    const uint32_t neg_inf_bits = 0xFF800000u;
    float neg_inf;
    std::memcpy(&neg_inf, &neg_inf_bits, sizeof neg_inf);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; ++r) {
        float* row = logits + rows[r] * row_stride;
        const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + r * words);
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t end = vocab - base < 32 ? vocab - base : 32;
            if (bits == 0) {
                for (int64_t b = 0; b < end; ++b) row[base + b] = neg_inf;
                continue;
            }
            for (int64_t b = 0; b < end; ++b)
                if (!((bits >> b) & 1u)) row[base + b] = neg_inf;
        }
    }
}

}  // namespace weir
