// Batched LoRA products: every row of a step's batch with its own adapter or none, one call per
// product group (Q/K/V, O, gate/up, down) for the whole batch: per row, the shrink (x A^T, the
// adapter's rank dot products per slice) then the expand (those values times B^T, added into
// the slice's output columns). Rows without an adapter are not touched, so a batch's rows of the
// base model compute exactly what they would in a batch with no adapter at all.

#include <cstdint>

#include "weir.h"

namespace weir {

void lora_add(const LoraGroup& g, const float* x, int64_t m, int64_t x_stride,
              const int32_t* row_slot, float* y, int64_t y_stride, int64_t num_threads) {
    const int64_t R = g.max_rank, K = g.k;
    parallel_for(m, m > 1 ? num_threads : 1, [&](int64_t t) {
        const int32_t slot = row_slot[t];
        if (slot < 0) return;
        const float* xr = x + t * x_stride;
        float* yr = y + t * y_stride;
        float v[kLoraMaxRank];
        for (int64_t s = 0; s < g.slices; ++s) {
            const int64_t r = g.ranks[slot * g.slices + s];
            if (r == 0) continue;
            const float* a = g.a + (slot * g.slices + s) * R * K;
            for (int64_t j = 0; j < r; ++j) {
                const float* aj = a + j * K;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t kk = 0; kk < K; ++kk) acc += xr[kk] * aj[kk];
                v[j] = acc;
            }
            const int64_t c0 = g.cols[s], c1 = g.cols[s + 1];
            const float* b = g.b + slot * R * g.n;
            for (int64_t j = 0; j < r; ++j) {
                const float vj = v[j];
                const float* bj = b + j * g.n;
#pragma omp simd
                for (int64_t c = c0; c < c1; ++c) yr[c] += vj * bj[c];
            }
        }
    });
}

}  // namespace weir
