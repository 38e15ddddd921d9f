// Batched LoRA products: every row of a step's batch with its own adapter or none, one call per
// product group (Q/K/V, O, gate/up, down) for the whole batch: per row, the shrink (x A^T, the
// adapter's rank dot products per slice) then the expand (those values times B^T, added into
// the slice's output columns). Rows without an adapter are not touched, so a batch's rows of the
// base model compute exactly what they would in a batch with no adapter at all.
//
// The rows are grouped by adapter (a counting sort of their slots), and a task takes a tile of
// up to MT rows of one adapter and one slice, so that each A and B row read serves the whole
// tile from registers: the shrink keeps MT x JB dot products' accumulators (rows by ranks) in
// vector registers over k, summed across lanes once at the end; the expand keeps MT rows by NV
// vectors of output columns, loading each B row's vectors once for the MT rows, and reads and
// writes y once per column block (not once per rank). Each output is the same sum in the same
// order whatever the batch. Adapters kept in bfloat16 (--lora-dtype) are widened to float32 as
// they are loaded: half the bytes to stream, the same arithmetic after.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "weir.h"

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int JB = 4;   // ranks per shrink block: MT x JB accumulators + MT x rows <= 32 zmm
constexpr int NV = 4;   // expand: MT x NV accumulators + NV B vectors <= 32 zmm
#else
constexpr int VW = 8;
constexpr int JB = 2;  // 16 ymm
constexpr int NV = 2;
#endif
constexpr int MT = 4;  // rows of one adapter a task takes
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
// bfloat16: the high half of a float32
inline vf load(const uint16_t* p) {
    const vu wide = __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu) << 16;
    return reinterpret_cast<const vf&>(wide);
}
inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float lanes_sum(vf v) {
    float s = 0.f;
    for (int l = 0; l < VW; ++l) s += v[l];
    return s;
}

// v[i * R + j] = x_i . a_j for the tile's M rows and the slice's r ranks (a: [r, K] rows).
template <int M, typename W>
void shrink(const float* const* xr, const W* a, int64_t r, int64_t K, float* v, int64_t R) {
    for (int64_t j0 = 0; j0 < r; j0 += JB) {
        const W* aj[JB];
        for (int j = 0; j < JB; ++j) aj[j] = a + std::min<int64_t>(j0 + j, r - 1) * K;
        vf acc[M][JB] = {};
        int64_t kk = 0;
        for (; kk + VW <= K; kk += VW) {
            vf xv[M];
            for (int i = 0; i < M; ++i) xv[i] = load(xr[i] + kk);
            for (int j = 0; j < JB; ++j) {
                const vf av = load(aj[j] + kk);
                for (int i = 0; i < M; ++i) acc[i][j] += xv[i] * av;
            }
        }
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < JB && j0 + j < r; ++j) {
                float s = lanes_sum(acc[i][j]);
                for (int64_t t = kk; t < K; ++t) s += xr[i][t] * scalar(aj[j][t]);
                v[i * R + j0 + j] = s;
            }
    }
}

// y_i[c] += sum_j v[i * R + j] b[j * n + c] for c in [c0, c1), the tile's M rows (ASSIGN: y_i[c]
// = that sum).
template <int M, bool ASSIGN, typename W>
void expand(float* const* yr, const float* v, int64_t R, const W* b, int64_t n, int64_t r,
            int64_t c0, int64_t c1) {
    int64_t c = c0;
    for (; c + NV * VW <= c1; c += NV * VW) {
        vf acc[M][NV];
        for (int i = 0; i < M; ++i)
            for (int u = 0; u < NV; ++u) acc[i][u] = ASSIGN ? vf{} : load(yr[i] + c + u * VW);
        for (int64_t j = 0; j < r; ++j) {
            vf bv[NV];
            for (int u = 0; u < NV; ++u) bv[u] = load(b + j * n + c + u * VW);
            for (int i = 0; i < M; ++i) {
                const float s = v[i * R + j];
                for (int u = 0; u < NV; ++u) acc[i][u] += bv[u] * s;
            }
        }
        for (int i = 0; i < M; ++i)
            for (int u = 0; u < NV; ++u) store(yr[i] + c + u * VW, acc[i][u]);
    }
    for (; c + VW <= c1; c += VW) {
        vf acc[M];
        for (int i = 0; i < M; ++i) acc[i] = ASSIGN ? vf{} : load(yr[i] + c);
        for (int64_t j = 0; j < r; ++j) {
            const vf bv = load(b + j * n + c);
            for (int i = 0; i < M; ++i) acc[i] += bv * v[i * R + j];
        }
        for (int i = 0; i < M; ++i) store(yr[i] + c, acc[i]);
    }
    for (; c < c1; ++c)
        for (int i = 0; i < M; ++i) {
            float s = ASSIGN ? 0.f : yr[i][c];
            for (int64_t j = 0; j < r; ++j) s += v[i * R + j] * scalar(b[j * n + c]);
            yr[i][c] = s;
        }
}

template <int M, typename W>
void tile(const float* const* xr, float* const* yr, const W* a, const W* b, int64_t r, int64_t K,
          int64_t n, int64_t c0, int64_t c1, bool assign) {
    float v[MT * weir::kLoraMaxRank];
    shrink<M>(xr, a, r, K, v, weir::kLoraMaxRank);
    if (assign)
        expand<M, true>(yr, v, weir::kLoraMaxRank, b, n, r, c0, c1);
    else
        expand<M, false>(yr, v, weir::kLoraMaxRank, b, n, r, c0, c1);
}

template <typename W>
void tile_of(int rows, const float* const* xr, float* const* yr, const void* a, const void* b,
             int64_t r, int64_t K, int64_t n, int64_t c0, int64_t c1, bool assign) {
    const W* aw = static_cast<const W*>(a);
    const W* bw = static_cast<const W*>(b);
    switch (rows) {
        case 1: return tile<1>(xr, yr, aw, bw, r, K, n, c0, c1, assign);
        case 2: return tile<2>(xr, yr, aw, bw, r, K, n, c0, c1, assign);
        case 3: return tile<3>(xr, yr, aw, bw, r, K, n, c0, c1, assign);
        default: return tile<4>(xr, yr, aw, bw, r, K, n, c0, c1, assign);
    }
}

struct Task {
    int64_t first;  // the tile's first position in the grouped order
    int32_t rows, slot, slice;
};

}  // namespace

namespace weir {

bool lora_add(const LoraGroup& g, const float* x, int64_t m, int64_t x_stride,
              const int32_t* row_slot, float* y, int64_t y_stride, int64_t num_threads,
              bool assign) {
    const int64_t R = g.max_rank, K = g.k, S = g.slots;
    // The rows with an adapter, grouped by slot (counting sort: each slot's rows in order).
    std::vector<int64_t> start(S + 1, 0);
    for (int64_t t = 0; t < m; ++t)
        if (row_slot[t] >= 0) ++start[row_slot[t] + 1];
    for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
    std::vector<int64_t> order(start[S]);
    {
        std::vector<int64_t> next(start.begin(), start.end() - 1);
        for (int64_t t = 0; t < m; ++t)
            if (row_slot[t] >= 0) order[next[row_slot[t]]++] = t;
    }
    std::vector<Task> tasks;
    for (int32_t s = 0; s < S; ++s)
        for (int64_t p = start[s]; p < start[s + 1]; p += MT)
            for (int32_t sl = 0; sl < g.slices; ++sl)
                if (g.ranks[s * g.slices + sl] > 0)
                    tasks.push_back({p, int32_t(std::min<int64_t>(MT, start[s + 1] - p)), s, sl});
    const int64_t n_tasks = int64_t(tasks.size());
    if (n_tasks == 0) return false;  // no adapter of the step modifies this group
    if (assign) {  // zeros where no task writes: rows without an adapter, slices of rank 0
        for (int64_t t = 0; t < m; ++t)
            if (row_slot[t] < 0) std::memset(y + t * y_stride, 0, sizeof(float) * g.n);
        for (int64_t s = 0; s < S; ++s)
            for (int64_t sl = 0; sl < g.slices; ++sl) {
                if (g.ranks[s * g.slices + sl] > 0) continue;
                const int64_t c0 = g.cols[sl], width = g.cols[sl + 1] - c0;
                for (int64_t p = start[s]; p < start[s + 1]; ++p)
                    std::memset(y + order[p] * y_stride + c0, 0, sizeof(float) * width);
            }
    }
    parallel_for(n_tasks, n_tasks > 1 ? num_threads : 1, [&](int64_t ti) {
        const Task& task = tasks[ti];
        const float* xr[MT];
        float* yr[MT];
        for (int i = 0; i < task.rows; ++i) {
            const int64_t t = order[task.first + i];
            xr[i] = x + t * x_stride;
            yr[i] = y + t * y_stride;
        }
        const int64_t r = g.ranks[task.slot * g.slices + task.slice];
        const int64_t a_off = (int64_t(task.slot) * g.slices + task.slice) * R * K;
        const int64_t b_off = int64_t(task.slot) * R * g.n;
        const int64_t c0 = g.cols[task.slice], c1 = g.cols[task.slice + 1];
        if (g.dtype == kBFloat16)
            tile_of<uint16_t>(task.rows, xr, yr, static_cast<const uint16_t*>(g.a) + a_off,
                              static_cast<const uint16_t*>(g.b) + b_off, r, K, g.n, c0, c1,
                              assign);
        else
            tile_of<float>(task.rows, xr, yr, static_cast<const float*>(g.a) + a_off,
                           static_cast<const float*>(g.b) + b_off, r, K, g.n, c0, c1, assign);
    });
    return true;
}

}  // namespace weir
