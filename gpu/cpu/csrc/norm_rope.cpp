// RMSNorm and rotary embedding for CPUs, in one pass per row, float32; Cohere's mean-centred
// layer norm beside them.
//
// torch runs RMSNorm as five element-wise ops (square, mean, add, rsqrt, two multiplies) and
// rotary embedding as five more (two slices, negate, concatenate, multiply-add), each a pass over
// memory; over Qwen3's per-head Q/K norms (tokens x heads rows of head_dim) those short rows cost
// more than the attention. Here each row is read once, normalized and rotated in registers and
// written once.
//
// The layouts are weir.h's (rms_norm_rope).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "weir.h"

namespace weir {

void rms_norm_rope(const float* x, int64_t tokens, int64_t heads, int64_t dim,
                   int64_t token_stride, const float* weight, float eps, const float* cos,
                   const float* sin, float* out, int64_t num_threads) {
    const int64_t rows = tokens * heads, half = dim / 2;
    // tasks of about 16k floats; fewer than 32k floats in all run on the caller alone
    const int64_t chunk = std::max<int64_t>(1, 16384 / dim);
    const int64_t tasks = (rows + chunk - 1) / chunk;
    parallel_for(tasks, rows * dim > 32768 ? num_threads : 1, [&](int64_t task) {
        for (int64_t r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
            const int64_t t = r / heads;
            const float* src = x + t * token_stride + (r % heads) * dim;
            float* dst = out + r * dim;
            float inv = 1.f;
            if (weight) {
                float ss = 0.f;
#pragma omp simd reduction(+ : ss)
                for (int64_t d = 0; d < dim; ++d) ss += src[d] * src[d];
                inv = 1.f / std::sqrt(ss / float(dim) + eps);
            }
            if (!cos) {
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) dst[d] = weight[d] * (src[d] * inv);
                continue;
            }
            const float* c = cos + t * dim;
            const float* s = sin + t * dim;
#pragma omp simd
            for (int64_t d = 0; d < half; ++d) {
                float a = src[d] * inv, b = src[d + half] * inv;
                if (weight) a *= weight[d], b *= weight[d + half];
                dst[d] = a * c[d] - b * s[d];
                dst[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    });
}

void layer_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight,
                const float* bias, float eps, float* out, int64_t num_threads) {
    const int64_t chunk = std::max<int64_t>(1, 16384 / dim);
    const int64_t tasks = (rows + chunk - 1) / chunk;
    parallel_for(tasks, rows * dim > 32768 ? num_threads : 1, [&](int64_t task) {
        for (int64_t r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
            const float* src = x + r * stride;
            float* dst = out + r * dim;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < dim; ++d) sum += src[d];
            const float mean = sum / float(dim);
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; ++d) ss += (src[d] - mean) * (src[d] - mean);
            const float inv = 1.f / std::sqrt(ss / float(dim) + eps);
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) dst[d] = weight[d] * ((src[d] - mean) * inv);
            if (bias)
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) dst[d] += bias[d];
        }
    });
}

}  // namespace weir
