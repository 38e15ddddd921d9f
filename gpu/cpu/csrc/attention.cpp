// Paged attention for CPUs: one pass over each sequence's K/V straight out of the paged cache.
//
// The torch reference gathers every sequence's context into a padded dense tensor per layer and
// step, then runs SDPA over it: the copy costs more than the attention. This reads each key and
// value row once, in place, with exact softmax (scores for the whole context, then max, exp and
// sum, then the weighted sum of V). K and V are read in chunks of up to 16 consecutive slots (all
// KV heads, contiguous within a block); a chunk serves every query head that shares its KV head
// (GQA) and every query row of the work item while it is in L1, four keys per pass over each
// query or accumulator row, and the next block is prefetched (block tables scatter blocks).
//
// The element conversions and the AVX-512 inner loops are in attention_simd.h.
//
// Declared in weir.h, called by ops.cpp's torch operator and by forward.cpp. Work items are (sequence, tile of query rows), spread over weir's pool
// (pool.h: claimed one at a time, no barrier waiting for a preempted thread);
// a decode row with a long context is split into parts of its keys, merged at the end (see run).
//
// Layouts (all contiguous): query/out [tokens, heads, dim]; caches [blocks, block_size, kv_heads,
// dim]; block_tables [seqs, max_blocks] int32; query_start [seqs + 1] int32; seq_lens [seqs].

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_simd.h"
#include "weir.h"

namespace {

struct Args {
    const void* query;
    const void* k_cache;
    const void* v_cache;
    void* out;
    const int32_t* block_tables;
    const int32_t* query_start;
    const int32_t* seq_lens;
    int64_t num_seqs;
    int64_t max_blocks;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    float scale;
    int64_t sliding_window;  // 0: none
    int64_t num_threads;
    float softcap;  // Gemma 2's: each score becomes softcap * tanh(score / softcap) (0: none)
    const float* sinks;  // gpt-oss's: per head, a logit in each softmax's sum only (or null)
};

// exp's argument is kept above -80 (e^-80 = 1.8e-35: next to a softmax sum of at least 1 it
// is lost in float32 either way). Below about -87 the result is subnormal, and glibc's vector
// exp (libmvec, what -ffast-math vectorizes std::exp to) then recomputes all 16 lanes with the
// scalar exp: peaked attention rows, common in a real forward, made the decode kernel 3-5x
// slower in the engine than on random data.
constexpr float kExpFloor = -80.f;

// Query rows per work item: rows of one tile share each K/V row read while it is in cache.
constexpr int64_t kRowTile = 16;
// Slots per chunk: a chunk's K (or V) rows, all KV heads, stay in L1 while every query of the
// item uses them.
constexpr int64_t kKeys = 16;

// Calls fn(first, n, rows) for each chunk of at most kKeys consecutive cache slots in [lo, hi) of
// one sequence (never crossing a block), with rows pointing at the chunk's first slot (all KV
// heads, `slot` floats per slot: in place for float caches, widened into buf for 16-bit and
// FP8 ones).
template <typename T, typename Fn>
inline void for_each_chunk(const T* cache, const int32_t* table, int64_t bs, int64_t slot,
                           int64_t lo, int64_t hi, float* buf, Fn&& fn) {
    for (int64_t b0 = lo - lo % bs; b0 < hi; b0 += bs) {
        const T* block = cache + int64_t(table[b0 / bs]) * bs * slot;
        const int64_t t1 = std::min(hi, b0 + bs);
        // The next block starts where the prefetcher cannot guess: ask for it now.
        if (b0 + bs < hi) {
            const char* next = reinterpret_cast<const char*>(
                cache + int64_t(table[(b0 + bs) / bs]) * bs * slot);
            const int64_t bytes = std::min(bs, hi - b0 - bs) * slot * int64_t(sizeof(T));
            for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(next + o);
        }
        for (int64_t t = std::max(lo, b0); t < t1; t += kKeys) {
            const int64_t n = std::min(kKeys, t1 - t);
            const T* rows = block + (t - b0) * slot;
            if constexpr (std::is_same_v<T, float>) {
                fn(t, n, rows);
            } else {
                widen(rows, n * slot, buf);
                fn(t, n, static_cast<const float*>(buf));
            }
        }
    }
}


// DD: the head size when known at compile time (32, 64, 128, 256), else 0 and a.head_dim is used.
// One item: query rows [row0, row1) of one sequence, all heads. K and V are read chunk by chunk
// (up to kKeys consecutive slots, all KV heads: contiguous in a block); each chunk serves every
// query that shares its KV head while it is in L1.
// A decode row's keys [k0, k1) only, when `part` is given (see run): the row's unnormalized
// weighted sum of V goes to part->acc with the part's softmax max and sum, for the merge.
struct Part {
    float* acc;  // [heads, dim]
    float* max;  // [heads]
    float* sum;  // [heads]
};

template <typename T, typename C, int64_t DD>
void run_item(const Args& a, int64_t seq, int64_t row0, int64_t row1, std::vector<float>& scores,
              std::vector<float>& qbuf, std::vector<float>& acc, std::vector<float>& kvbuf,
              int64_t k0 = 0, int64_t k1 = INT64_MAX, const Part* part = nullptr) {
    const T* q = static_cast<const T*>(a.query);
    const C* kc = static_cast<const C*>(a.k_cache);
    const C* vc = static_cast<const C*>(a.v_cache);
    T* out = static_cast<T*>(a.out);
    const int64_t D = DD ? DD : a.head_dim;
    const int64_t H = a.num_heads, Hkv = a.num_kv_heads, bs = a.block_size;
    const int64_t G = H / Hkv;
    const int64_t qs = a.query_start[seq];
    const int64_t q_len = a.query_start[seq + 1] - qs;
    const int64_t seq_len = a.seq_lens[seq];
    const int32_t* table = a.block_tables + seq * a.max_blocks;
    const int64_t slot = Hkv * D;  // elements per cache slot (all KV heads)

    // Query row r sits at position first_pos + r and sees keys [lo(r), first_pos + r].
    const int64_t first_pos = seq_len - q_len;
    const int64_t hi_max = std::min(first_pos + row1, k1);  // exclusive end for the last row
    int64_t lo_min = 0;
    if (a.sliding_window > 0) lo_min = std::max<int64_t>(0, first_pos + row0 + 1 - a.sliding_window);
    lo_min = std::max(lo_min, k0);
    const int64_t span = hi_max - lo_min;
    const int64_t nrows = row1 - row0;
    const int64_t nq = G * nrows;    // queries per KV head
    const int64_t rows = H * nrows;  // (row, head) pairs, head-major: i = h * nrows + (r - row0)

    qbuf.resize(rows * D);
    scores.resize(rows * span);
    acc.assign(rows * D, 0.f);
    kvbuf.resize(kKeys * slot);
    for (int64_t r = 0; r < nrows; ++r)
        for (int64_t h = 0; h < H; ++h) {
            const T* src = q + ((qs + row0 + r) * H + h) * D;
            float* dst = qbuf.data() + (h * nrows + r) * D;
            // (widened K in kv_unit<C>: scores as from K itself, exactly: a power of two)
            for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * (a.scale * kv_unit<C>);
        }

    // Pass 1: scores for every key in the tile's range (masked per row below).
    for_each_chunk<C>(kc, table, bs, slot, lo_min, hi_max, kvbuf.data(),
                      [&](int64_t t, int64_t n, const float* k) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const float* kg = k + g * D;
            if constexpr (kAvx512 && DD > 0 && DD % 16 == 0) {
                for (int64_t i = g * nq; i < (g + 1) * nq; ++i)
                    scores16<DD>(qbuf.data() + i * D, kg, slot, n,
                                 scores.data() + i * span + (t - lo_min));
                continue;
            }
            for (int64_t i = g * nq; i < (g + 1) * nq; ++i) {
                const float* __restrict qi = qbuf.data() + i * D;
                float* st = scores.data() + i * span + (t - lo_min);
                int64_t j = 0;
                for (; j + 4 <= n; j += 4) {
                    const float *k0 = kg + j * slot, *k1 = k0 + slot, *k2 = k1 + slot, *k3 = k2 + slot;
                    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                    for (int64_t d = 0; d < D; ++d) {
                        s0 += qi[d] * k0[d];
                        s1 += qi[d] * k1[d];
                        s2 += qi[d] * k2[d];
                        s3 += qi[d] * k3[d];
                    }
                    st[j] = s0, st[j + 1] = s1, st[j + 2] = s2, st[j + 3] = s3;
                }
                for (; j < n; ++j) {
                    const float* kj = kg + j * slot;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qi[d] * kj[d];
                    st[j] = s;
                }
            }
        }
    });
    // Softmax per (row, head) over its own visible range; masked keys get probability 0.
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t end = first_pos + row0 + i % nrows + 1;
        const int64_t hi = std::min(end, k1);
        const int64_t lo = std::max(
            k0, a.sliding_window > 0 ? std::max<int64_t>(0, end - a.sliding_window) : 0);
        float* s = scores.data() + i * span - lo_min;
        if (a.softcap > 0.f) {  // as transformers caps them: divided, tanh, multiplied
            const float c = a.softcap;
#pragma omp simd
            for (int64_t t = lo; t < hi; ++t) s[t] = std::tanh(s[t] / c) * c;
        }
        // A vector max: written as a plain loop g++ kept the running max in memory (a store
        // and reload per key, a large share of the kernel's time in decode).
        float m = s[lo];
#pragma omp simd reduction(max : m)
        for (int64_t t = lo; t < hi; ++t) m = m > s[t] ? m : s[t];
        // A sink takes its share of the row's probability and gives no value (a split row's
        // sink is counted once, in the merge).
        const bool has_sink = a.sinks && !part;  // (no infinities: built with -ffast-math)
        if (has_sink) m = std::max(m, a.sinks[i / nrows]);
        float sum = 0.f;
        for (int64_t t = lo_min; t < lo; ++t) s[t] = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = lo; t < hi; ++t) {
            s[t] = std::exp(std::max(s[t] - m, kExpFloor));
            sum += s[t];
        }
        for (int64_t t = hi; t < hi_max; ++t) s[t] = 0.f;
        if (has_sink) sum += std::exp(std::max(a.sinks[i / nrows] - m, kExpFloor));
        if (part) {  // normalized in the merge, with the other parts' maxima and sums
            part->max[i] = m;
            part->sum[i] = sum;
            continue;
        }
        const float inv = 1.f / sum;
        for (int64_t t = lo; t < hi; ++t) s[t] *= inv;
    }
    // Pass 2: weighted sum of values, four keys per update of each accumulator.
    for_each_chunk<C>(vc, table, bs, slot, lo_min, hi_max, kvbuf.data(),
                      [&](int64_t t, int64_t n, const float* v) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const float* vg = v + g * D;
            if constexpr (kAvx512 && DD > 0 && DD % 16 == 0) {
                wsum16<DD>(vg, slot, n, scores.data() + g * nq * span + (t - lo_min), span,
                           acc.data() + g * nq * D, nq);
                continue;
            }
            for (int64_t i = g * nq; i < (g + 1) * nq; ++i) {
                const float* p = scores.data() + i * span + (t - lo_min);
                float* __restrict ai = acc.data() + i * D;
                int64_t j = 0;
                for (; j + 4 <= n; j += 4) {
                    const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
                    const float *v0 = vg + j * slot, *v1 = v0 + slot, *v2 = v1 + slot, *v3 = v2 + slot;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d)
                        ai[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
                }
                for (; j < n; ++j) {
                    const float pj = p[j];
                    const float* vj = vg + j * slot;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) ai[d] += pj * vj[d];
                }
            }
        }
    });
    if (part) {
        if constexpr (kv_unit<C> == 1.f)
            std::memcpy(part->acc, acc.data(), sizeof(float) * rows * D);
        else  // widened V in kv_unit<C>: back to values (exactly: a power of two)
            for (int64_t e = 0; e < rows * D; ++e) part->acc[e] = acc[e] * kv_unit<C>;
        return;
    }
    for (int64_t r = 0; r < nrows; ++r)
        for (int64_t h = 0; h < H; ++h) {
            T* dst = out + ((qs + row0 + r) * H + h) * D;
            const float* ai = acc.data() + (h * nrows + r) * D;
            for (int64_t d = 0; d < D; ++d) store(dst + d, ai[d] * kv_unit<C>);
        }
}

// The parts of one decode row, in order: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
template <typename T>
void merge_parts(const Args& a, int64_t token, const float* acc, const float* max,
                 const float* sum, int64_t parts) {
    const int64_t H = a.num_heads, D = a.head_dim;
    T* out = static_cast<T*>(a.out);
    std::vector<float> o(D);
    for (int64_t h = 0; h < H; ++h) {
        float m = max[h];
        for (int64_t p = 1; p < parts; ++p) m = std::max(m, max[p * H + h]);
        if (a.sinks) m = std::max(m, a.sinks[h]);
        std::fill(o.begin(), o.end(), 0.f);
        float l = a.sinks ? std::exp(std::max(a.sinks[h] - m, kExpFloor)) : 0.f;
        for (int64_t p = 0; p < parts; ++p) {
            const float w = std::exp(std::max(max[p * H + h] - m, kExpFloor));
            l += w * sum[p * H + h];
            const float* ap = acc + (p * H + h) * D;
            for (int64_t d = 0; d < D; ++d) o[d] += w * ap[d];
        }
        T* dst = out + (token * H + h) * D;
        for (int64_t d = 0; d < D; ++d) store(dst + d, o[d] / l);
    }
}

// A decode row whose context is longer than kPartKeys is split into parts of kPartKeys keys
// (aligned, so a sequence is split the same way in any batch and on any number of threads: the
// result never depends on either), computed as separate work items and merged: one sequence's
// decode then reads its K/V on every thread, where it used to be one item on one thread
// (figures: docs/benchmarks.md, "Figures moved out of the code").
constexpr int64_t kPartKeys = 512;

template <typename T, typename C, int64_t DD>
void run(const Args& a) {
    struct Item {
        int32_t seq, row0, row1;
        int64_t k0, k1;  // the key part of a split decode row, else [0, max)
        int64_t part;    // its first slot in the part buffers, or -1
    };
    struct Split {
        int32_t seq;
        int64_t first, parts;
    };
    std::vector<Item> items;
    std::vector<Split> splits;
    int64_t n_parts = 0;
    for (int32_t seq = 0; seq < a.num_seqs; ++seq) {
        const int32_t q_len = a.query_start[seq + 1] - a.query_start[seq];
        const int64_t len = a.seq_lens[seq];
        const int64_t lo = a.sliding_window > 0 ? std::max<int64_t>(0, len - a.sliding_window) : 0;
        if (q_len == 1 && len - lo > kPartKeys) {
            const int64_t first = n_parts;
            for (int64_t k0 = lo - lo % kPartKeys; k0 < len; k0 += kPartKeys)
                items.push_back({seq, 0, 1, std::max(k0, lo), k0 + kPartKeys, n_parts++});
            splits.push_back({seq, first, n_parts - first});
            continue;
        }
        for (int32_t r = 0; r < q_len; r += kRowTile)
            items.push_back({seq, r, std::min<int32_t>(q_len, r + kRowTile), 0, INT64_MAX, -1});
    }
    const int64_t H = a.num_heads, D = a.head_dim;
    std::vector<float> part_acc(n_parts * H * D), part_max(n_parts * H), part_sum(n_parts * H);
    const int64_t n_items = int64_t(items.size());
    const int64_t n_splits = int64_t(splits.size());
    weir::parallel_for(n_items, a.num_threads, [&](int64_t i) {
        thread_local std::vector<float> scores, qbuf, acc, kvbuf;  // grown once per thread
        const Item& it = items[i];
        if (it.part < 0) {
            run_item<T, C, DD>(a, it.seq, it.row0, it.row1, scores, qbuf, acc, kvbuf);
            return;
        }
        const Part part{part_acc.data() + it.part * H * D, part_max.data() + it.part * H,
                        part_sum.data() + it.part * H};
        run_item<T, C, DD>(a, it.seq, 0, 1, scores, qbuf, acc, kvbuf, it.k0, it.k1, &part);
    });
    weir::parallel_for(n_splits, a.num_threads, [&](int64_t i) {
        const Split& sp = splits[i];
        merge_parts<T>(a, a.query_start[sp.seq], part_acc.data() + sp.first * H * D,
                       part_max.data() + sp.first * H, part_sum.data() + sp.first * H, sp.parts);
    });
}

template <typename T, typename C>
void run_dim(const Args& a) {
    switch (a.head_dim) {
        case 32: return run<T, C, 32>(a);
        case 64: return run<T, C, 64>(a);
        case 128: return run<T, C, 128>(a);
        case 256: return run<T, C, 256>(a);
        default: return run<T, C, 0>(a);
    }
}

}  // namespace

namespace weir {

int paged_attention(const void* query, const void* k_cache, const void* v_cache, void* out,
                    const int32_t* block_tables, const int32_t* query_start,
                    const int32_t* seq_lens, int64_t num_seqs, int64_t max_blocks,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, int64_t sliding_window, int64_t num_threads,
                    int dtype, int cache_dtype, float softcap, const float* sinks) {
    const Args a{query,       k_cache,      v_cache,  out,        block_tables,
                 query_start, seq_lens,     num_seqs, max_blocks,
                 num_heads,   num_kv_heads, head_dim, block_size, scale,
                 sliding_window, num_threads, softcap, sinks};
    switch (dtype * 8 + cache_dtype) {
        case 0: run_dim<float, float>(a); return 0;
        case 1: run_dim<float, uint16_t>(a); return 0;
        case 2: run_dim<float, _Float16>(a); return 0;
        case 3: run_dim<float, Fp8E5M2>(a); return 0;
        case 4: run_dim<float, Fp8E4M3>(a); return 0;
        case 9: run_dim<uint16_t, uint16_t>(a); return 0;
        case 11: run_dim<uint16_t, Fp8E5M2>(a); return 0;
        case 12: run_dim<uint16_t, Fp8E4M3>(a); return 0;
        case 18: run_dim<_Float16, _Float16>(a); return 0;
        case 19: run_dim<_Float16, Fp8E5M2>(a); return 0;
        case 20: run_dim<_Float16, Fp8E4M3>(a); return 0;
    }
    return -1;
}

}  // namespace weir
