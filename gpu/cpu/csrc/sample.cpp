// Greedy sampling's argmax on the CPU: for each row of float32 logits, the index torch.argmax
// gives (the first of equal maxima; a NaN counts as larger than any number, the first NaN wins).
// torch's own wakes its OpenMP team for a 64-row step's logits; here the rows go to weir's pool
// (pool.h) when there are enough of them, else run on the calling thread.
//
// The library is built with -ffast-math, which lets the compiler assume no NaN: NaN is found
// from the bits (exponent all ones, mantissa not zero), never by a float comparison.

#include <cstdint>
#include <cstring>

#include "weir.h"

namespace {

inline bool is_nan(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

int64_t row_argmax(const float* x, int64_t n) {
    uint32_t nan_seen = 0;
    float best = x[0];
#pragma omp simd reduction(| : nan_seen) reduction(max : best)
    for (int64_t j = 0; j < n; ++j) {
        uint32_t u;
        std::memcpy(&u, x + j, 4);
        nan_seen |= (u & 0x7fffffffu) > 0x7f800000u;
        best = x[j] > best ? x[j] : best;
    }
    for (int64_t j = 0; j < n; ++j)
        if (nan_seen ? is_nan(x[j]) : x[j] == best) return j;
    return 0;  // not reached: the maximum is one of the row's values
}

}  // namespace

namespace weir {

void argmax(const float* logits, int64_t rows, int64_t cols, int64_t stride, int64_t* out,
            int64_t num_threads) {
    const bool parallel = num_threads > 1 && rows > 1 && rows * cols > (1 << 16);
    parallel_for(rows, parallel ? num_threads : 1,
                       [&](int64_t r) { out[r] = row_argmax(logits + r * stride, cols); });
}

}  // namespace weir
