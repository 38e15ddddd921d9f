// Matrix products for the CPU forward: out = x @ W^T (+ bias) (+ residual), or the gated MLP's
// silu(x @ G^T) * (x @ U^T), float32, on weights packed once at load time.
//
// Why not oneDNN (gpu/cpu/onednn.py) for every product: a decode step is many small products
// (1 to 64 rows), and oneDNN splits each one statically over the threads and joins them at a
// barrier. When another process takes a core for a moment (the HTTP server, the client: a 2-core
// box), the whole step waits for the descheduled thread's half (issue 18). Here each product is
// cut into column panels taken from a shared counter by weir's pool (pool.h): a thread
// that is descheduled holds up at most one panel, one that has not woken up none. Each output is one sum over
// k in order, whatever the batch, so a request's logits do not depend on what it is batched with.
//
// Packed layout: the N outputs in panels of NB columns (NB = 4 vector registers: 64 floats with
// AVX-512, 32 with AVX2), each panel K rows of NB floats, zero-padded past N. A gated pair is
// packed so that each panel holds NB/2 gate columns and the same NB/2 up columns: the panel's
// product gives NB/2 finished outputs of silu(g) * u, and the [rows, 2m] intermediate is never
// written. Micro-kernel: MR rows x NB columns of accumulators in registers, one broadcast of x
// and NB/VW loads of the panel per k.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "activation.h"
#include "weir.h"

namespace {

using weir::gelu;
using weir::gelu_tanh;
using weir::silu;

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int MR = 6;   // rows per micro-tile: 6 x 4 accumulators + 4 panel vectors <= 32 zmm
#else
constexpr int VW = 8;
constexpr int MR = 3;   // 3 x 4 accumulators + 4 panel vectors <= 16 ymm
#endif
constexpr int NV = 4;
constexpr int NB = VW * NV;
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

// Rows per task in large products: a block of x rows against one panel (both stay in L2). 16
// micro-tiles (96 rows with AVX-512) measured best of the sizes tried; a decode step of up to
// 96 rows is one block (figures: docs/benchmarks.md, "Figures moved out of the code").
constexpr int64_t MB = MR * 16;
// Panel rows per pass: KC x NB floats (8 KB with AVX-512) stay in L1 across the block's tiles
// while the next KC rows are prefetched (see rows). With the prefetch, 32 measured best of the
// sizes tried, weights from L3 or memory as in a forward (figures: docs/benchmarks.md).
constexpr int64_t KC = 32;

struct Args {
    const float* x;
    int64_t m, k, x_stride;
    const float* packed;
    int64_t n;      // outputs (of the gated pair: the up/gate width m, i.e. outputs written)
    int gated;      // 0: a plain product; 1, 2, 3: a gated pair with SiLU, GELU, GELU (tanh)
    const float* bias;
    const float* residual;
    int64_t res_stride;
    float* out;
    int64_t out_stride;
    const float* xp;  // x packed by micro-tile ([m / MR][k][MR]), or null: read x in place
};

// acc[r * NB + j] += sum over k in [k0, k1) of x[row0 + r, k] * panel[k, j], in k order (so
// the chunks of one sum add up in the same order as one pass would).
template <int R, bool P>
void tile(const Args& a, int64_t row0, const float* bp, int64_t k0, int64_t k1, float* acc,
          bool first) {
    // element (r, kk) of the tile's rows: packed, x[kk * MR + r]; in place, x[r * stride + kk]
    const float* x = P ? a.xp + row0 * a.k : a.x + row0 * a.x_stride;
    const int64_t rs = P ? 1 : a.x_stride, ks = P ? MR : 1;
    vf c[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) c[r][v] = first ? vf{} : *(const vf*)(acc + r * NB + v * VW);
    for (int64_t kk = k0; kk < k1; ++kk) {
        vf b[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) b[v] = *(const vfu*)(bp + kk * NB + v * VW);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const float xv = x[r * rs + kk * ks];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) c[r][v] += xv * b[v];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) *(vf*)(acc + r * NB + v * VW) = c[r][v];
}

template <int R, bool P>
void tail(const Args& a, int64_t row, int64_t left, const float* bp, int64_t k0, int64_t k1,
          float* acc, bool first) {
    if constexpr (R > 0) {
        if (left == R) return tile<R, P>(a, row, bp, k0, k1, acc, first);
        tail<R - 1, P>(a, row, left, bp, k0, k1, acc, first);
    }
}

// Rows [row0, row1) (at most MB) against one panel: the panel in chunks of KC rows that stay in
// L1 while every micro-tile of the block passes over them, then the epilogue.
//
// While a chunk's tiles run, the next KC panel rows (after the last chunk, the next panel's
// first) are prefetched into L2, a share before each tile: the weights of a forward (tens of MB)
// come from L3 or memory, and without it the first tile over each chunk waits for every line.
void rows(const Args& a, int64_t row0, int64_t row1, int64_t panel, int64_t panels) {
    alignas(64) float acc[MB * NB];
    const float* bp = a.packed + panel * a.k * NB;
    const int64_t tiles = (row1 - row0 + MR - 1) / MR;
    for (int64_t k0 = 0; k0 < a.k || k0 == 0; k0 += KC) {
        const int64_t k1 = std::min(a.k, k0 + KC);
        // One tile (a decode of a few rows) streams the panel: the hardware prefetcher keeps up
        // with it, and the prefetches measured a few percent slower.
        const char* next = nullptr;
        int64_t next_bytes = 0;
        if (tiles > 1 && k1 < a.k) {
            next = (const char*)(bp + k1 * NB);
            next_bytes = std::min(KC, a.k - k1) * NB * 4;
        } else if (tiles > 1 && panel + 1 < panels) {
            next = (const char*)(bp + a.k * NB);
            next_bytes = std::min(KC, a.k) * NB * 4;
        }
        const int64_t share = (next_bytes / 64 + tiles - 1) / tiles * 64;
        int64_t r = row0;
        for (int64_t t = 0; r < row1; ++t, r += MR) {
            for (int64_t b = t * share; b < std::min(next_bytes, (t + 1) * share); b += 64)
                __builtin_prefetch(next + b, 0, 2);
            float* c = acc + (r - row0) * NB;
            if (a.xp && r + MR <= row1)
                tile<MR, true>(a, r, bp, k0, k1, c, k0 == 0);
            else if (a.xp)
                tail<MR - 1, true>(a, r, row1 - r, bp, k0, k1, c, k0 == 0);
            else if (r + MR <= row1)
                tile<MR, false>(a, r, bp, k0, k1, c, k0 == 0);
            else
                tail<MR - 1, false>(a, r, row1 - r, bp, k0, k1, c, k0 == 0);
        }
        if (k1 >= a.k) break;
    }
    if (!a.gated) {
        const int64_t n0 = panel * NB, cols = std::min<int64_t>(NB, a.n - n0);
        for (int64_t r = row0; r < row1; ++r) {
            const float* c = acc + (r - row0) * NB;
            float* o = a.out + r * a.out_stride + n0;
            const float* res = a.residual ? a.residual + r * a.res_stride + n0 : nullptr;
            const float* bias = a.bias ? a.bias + n0 : nullptr;
#pragma omp simd
            for (int64_t j = 0; j < cols; ++j) {
                float v = c[j];
                if (bias) v += bias[j];
                if (res) v += res[j];
                o[j] = v;
            }
        }
        return;
    }
    constexpr int H = NB / 2;
    const int64_t n0 = panel * H, cols = std::min<int64_t>(H, a.n - n0);
    if (a.residual) {  // a pre-activation addend [m, 2n]: gate's, then up's (LoRA deltas)
        // vectorized as the loops below are (the same exp), so a row whose addend is zero gets
        // what it gets without one
        for (int64_t r = row0; r < row1; ++r) {
            const float* c = acc + (r - row0) * NB;
            const float* g = a.residual + r * a.res_stride + n0;
            const float* u = g + a.n;
            float* o = a.out + r * a.out_stride + n0;
            if (a.gated == 1) {
#pragma omp simd
                for (int64_t j = 0; j < cols; ++j) o[j] = silu(c[j] + g[j]) * (c[H + j] + u[j]);
            } else if (a.gated == 2) {
#pragma omp simd
                for (int64_t j = 0; j < cols; ++j) o[j] = gelu(c[j] + g[j]) * (c[H + j] + u[j]);
            } else {
#pragma omp simd
                for (int64_t j = 0; j < cols; ++j)
                    o[j] = gelu_tanh(c[j] + g[j]) * (c[H + j] + u[j]);
            }
        }
        return;
    }
    for (int64_t r = row0; r < row1; ++r) {
        const float* c = acc + (r - row0) * NB;
        float* o = a.out + r * a.out_stride + n0;
        if (a.gated == 1) {
#pragma omp simd
            for (int64_t j = 0; j < cols; ++j) o[j] = silu(c[j]) * c[H + j];
        } else if (a.gated == 2) {
#pragma omp simd
            for (int64_t j = 0; j < cols; ++j) o[j] = gelu(c[j]) * c[H + j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < cols; ++j) o[j] = gelu_tanh(c[j]) * c[H + j];
        }
    }
}

int64_t panels_of(int64_t n, int gated) {
    const int64_t cols = gated ? NB / 2 : NB;  // outputs a panel gives
    return (n + cols - 1) / cols;
}

}  // namespace

namespace weir {

int64_t gemm_packed_size(int64_t n, int64_t k, bool gated) {
    return panels_of(n, gated) * k * NB;
}

void gemm_pack(const float* w, const float* w2, int64_t n, int64_t k, bool gated,
               float* packed) {
    const int64_t panels = panels_of(n, gated);
    parallel_for(panels, int64_t(std::thread::hardware_concurrency()), [&](int64_t p) {
        float* dst = packed + p * k * NB;
        std::memset(dst, 0, sizeof(float) * k * NB);
        for (int64_t j = 0; j < NB; ++j) {
            const float* src;
            if (!gated) {
                const int64_t col = p * NB + j;
                if (col >= n) continue;
                src = w + col * k;
            } else {
                const int64_t col = p * (NB / 2) + j % (NB / 2);
                if (col >= n) continue;
                src = (j < NB / 2 ? w : w2) + col * k;
            }
            for (int64_t kk = 0; kk < k; ++kk) dst[kk * NB + j] = src[kk];
        }
    });
}

// gated: act(x G^T) * (x U^T) with act SiLU (1), GELU (2) or GELU's tanh form (3).
void gemm(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
          int gated, const float* bias, const float* residual, int64_t res_stride, float* out,
          int64_t out_stride, int64_t num_threads) {
    const int64_t panels = panels_of(n, gated);
    const int64_t blocks = (m + MB - 1) / MB;
    const int64_t tasks = panels * blocks;
    // A product too small to be worth waking the other threads runs here.
    const bool parallel = num_threads > 1 && tasks > 1 && m * n * k > (1 << 15);
    // Up to three blocks of x (a decode step, a short prefill) go panel-major: a panel is read
    // from memory once, then from cache for each block. Four or more (a prefill chunk) go
    // block-major: the threads share one x block, which stays in their L2 while the panels
    // stream past it (prefetched, see rows), where panel-major re-read all of x from L3 for
    // every panel: faster from four blocks up, level at two (figures: docs/benchmarks.md).
    const bool block_major = blocks >= 4;
    // The packed copy of x below is bounded: a product with more of x than kMaxPacked floats
    // (a long prefill chunk through a wide MLP: 2,048 x 14,336 floats is 117 MB) runs as
    // passes over row ranges of whole blocks, each the same per-row work as one pass.
    constexpr int64_t kMaxPacked = int64_t(1) << 22;  // floats: 16 MB
    if (block_major && m * k > kMaxPacked) {
        const int64_t step = std::max<int64_t>(4, kMaxPacked / k / MB) * MB;
        if (step < m) {
            for (int64_t r0 = 0; r0 < m; r0 += step) {
                const float* res = residual ? residual + r0 * res_stride : nullptr;
                gemm(x + r0 * x_stride, std::min(step, m - r0), k, x_stride, packed, n,
                          gated, bias, res, res_stride, out + r0 * out_stride, out_stride,
                          num_threads);
            }
            return;
        }
    }
    // Block-major, x is first copied micro-tile by micro-tile ([m / MR][k][MR], zero rows past
    // m): a tile then reads one contiguous stream instead of MR rows k floats apart. One more
    // pass over x, and faster at every size measured (figures: docs/benchmarks.md).
    // Each output is the same sum in the same order whichever way it goes.
    static thread_local std::vector<float> xp;  // the caller's, grown once
    if (block_major) {
        const int64_t tiles = (m + MR - 1) / MR;
        if (int64_t(xp.size()) < tiles * MR * k) xp.resize(tiles * MR * k);
        float* base = xp.data();
        parallel_for(tiles, parallel ? num_threads : 1, [&](int64_t t) {
            float* dst = base + t * MR * k;
            const int64_t rows = std::min<int64_t>(MR, m - t * MR);
            for (int64_t r = 0; r < MR; ++r) {
                const float* src = x + (t * MR + r) * x_stride;
                if (r < rows)
                    for (int64_t kk = 0; kk < k; ++kk) dst[kk * MR + r] = src[kk];
                else
                    for (int64_t kk = 0; kk < k; ++kk) dst[kk * MR + r] = 0.f;
            }
        });
    }
    const Args a{x,        m,        k,          x_stride, packed,     n,
                 gated,    bias,     residual,   res_stride, out,      out_stride,
                 block_major ? xp.data() : nullptr};
    parallel_for(tasks, parallel ? num_threads : 1, [&](int64_t t) {
        const int64_t panel = block_major ? t % panels : t / blocks;
        const int64_t block = block_major ? t / panels : t % blocks;
        rows(a, block * MB, std::min(m, (block + 1) * MB), panel, panels);
    });
}

}  // namespace weir
