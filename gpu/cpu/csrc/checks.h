// Checks of the tensors a torch operator is given, before a kernel sees a pointer (ops.cpp,
// stack.cpp): dtype, device, rank, sizes, strides, and the indexes the kernels follow.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "decoder.h"

namespace weir_ops {

using at::Tensor;
using c10::optional;

inline int64_t threads() { return at::get_num_threads(); }

inline void check_cpu(const Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), name, ": missing");
    TORCH_CHECK(t.device().is_cpu(), name, ": needs a CPU tensor, got ", t.device());
}

inline void check_f32(const Tensor& t, const char* name) {
    check_cpu(t, name);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, name, ": needs float32, got ",
                      t.scalar_type());
}

// A contiguous tensor of `type` with `numel` elements.
inline void check_flat(const Tensor& t, at::ScalarType type, int64_t numel, const char* name) {
    check_cpu(t, name);
    TORCH_CHECK_VALUE(t.scalar_type() == type, name, ": needs ", type, ", got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, ": must be contiguous");
    TORCH_CHECK_VALUE(t.numel() == numel, name, ": needs ", numel, " elements, got ", t.numel());
}

// A [rows, cols] float32 matrix whose rows are contiguous (any row stride >= cols).
inline void check_rows(const Tensor& t, int64_t rows, int64_t cols, const char* name) {
    check_f32(t, name);
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, ": needs [",
                      rows, ", ", cols, "], got ", t.sizes());
    TORCH_CHECK_VALUE(rows == 0 || (t.stride(1) == 1 && t.stride(0) >= cols), name,
                      ": rows must be contiguous");
}

inline int dtype_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return weir::kFloat32;
        case at::kBFloat16: return weir::kBFloat16;
        case at::kHalf: return weir::kFloat16;
        default: return -1;
    }
}

// A K/V cache's element type: dtype_code's, or FP8 (a cache under any query).
inline int cache_code(at::ScalarType t) {
    if (t == at::kFloat8_e5m2) return weir::kFp8E5M2;
    if (t == at::kFloat8_e4m3fn) return weir::kFp8E4M3;
    return dtype_code(t);
}

// ---- the paged cache's step layout: the indexes the attention and K/V writes follow ----
struct Paged {
    int64_t num_blocks, block_size, num_seqs, max_blocks;
};

// k_cache [blocks, block_size, kv_heads, dim]; block_tables [seqs, max_blocks] int32;
// query_start [seqs + 1] int32 (0, ..., tokens, non-decreasing); seq_lens [seqs] int32, each at
// least its query length and within its table; every block id a sequence reaches in range.
inline Paged check_paged(const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                  const Tensor& query_start, const Tensor& seq_lens, int64_t tokens) {
    check_cpu(k_cache, "k_cache");
    check_cpu(v_cache, "v_cache");
    TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                      "caches: need two [blocks, block_size, kv_heads, dim] tensors, got ",
                      k_cache.sizes(), " and ", v_cache.sizes());
    TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                      "caches must be contiguous");
    check_cpu(block_tables, "block_tables");
    TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                          block_tables.is_contiguous(),
                      "block_tables: needs a contiguous [seqs, max_blocks] int32 tensor");
    const int64_t seqs = block_tables.size(0), width = block_tables.size(1);
    check_flat(query_start, at::kInt, seqs + 1, "query_start");
    check_flat(seq_lens, at::kInt, seqs, "seq_lens");
    const Paged p{k_cache.size(0), k_cache.size(1), seqs, width};
    const int32_t* qs = query_start.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    TORCH_CHECK_INDEX(qs[0] == 0 && qs[seqs] == tokens, "query_start must run from 0 to ",
                      tokens);
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t q = qs[s + 1] - qs[s], len = lens[s];
        TORCH_CHECK_INDEX(q >= 0 && len >= q, "sequence ", s, ": ", q, " query rows, ", len,
                          " keys");
        TORCH_CHECK_INDEX(len <= width * p.block_size, "sequence ", s, ": ", len,
                          " keys past its block table");
        for (int64_t b = 0; b < (len + p.block_size - 1) / p.block_size; ++b) {
            const int64_t id = tables[s * width + b];
            TORCH_CHECK_INDEX(id >= 0 && id < p.num_blocks, "block id ", id, " outside the ",
                              p.num_blocks, " blocks of the cache");
        }
    }
    return p;
}


inline void check_packed(const Tensor& packed, int64_t n, int64_t k, bool gated) {
    check_flat(packed, at::kFloat, weir::gemm_packed_size(n, k, gated), "packed");
}

// ---- LoRA ----
// One product group's adapter slots (weir.h LoraGroup): a [slots, slices, max_rank, k] and b
// [slots, max_rank, n], both float32 or both bfloat16, ranks [slots, slices] int32 each within max_rank, cols
// [slices + 1] int64 from 0 up to n. The ranks are read on every call: Python rewrites them
// when it loads an adapter into a slot.
inline weir::LoraGroup check_lora_group(const Tensor& a, const Tensor& b, const Tensor& ranks,
                                        const Tensor& cols) {
    check_cpu(a, "lora a");
    check_cpu(b, "lora b");
    TORCH_CHECK_VALUE((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                          b.scalar_type() == a.scalar_type(),
                      "lora a, b: need float32 or bfloat16, both the same, got ", a.scalar_type(),
                      " and ", b.scalar_type());
    TORCH_CHECK_VALUE(a.dim() == 4 && a.is_contiguous(),
                      "lora a: needs a contiguous [slots, slices, max_rank, k] tensor");
    const int64_t S = a.size(0), slices = a.size(1), R = a.size(2), K = a.size(3);
    TORCH_CHECK_VALUE(R >= 1 && R <= weir::kLoraMaxRank, "lora: max rank ", R, " not in [1, ",
                      weir::kLoraMaxRank, "]");
    TORCH_CHECK_VALUE(b.dim() == 3 && b.is_contiguous() && b.size(0) == S && b.size(1) == R,
                      "lora b: needs a contiguous [", S, ", ", R, ", n] tensor, got ", b.sizes());
    const int64_t N = b.size(2);
    check_flat(ranks, at::kInt, S * slices, "lora ranks");
    check_flat(cols, at::kLong, slices + 1, "lora cols");
    const int64_t* c = cols.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(c[0] == 0 && c[slices] == N, "lora cols: must run from 0 to ", N);
    for (int64_t s = 0; s < slices; ++s)
        TORCH_CHECK_VALUE(c[s] <= c[s + 1], "lora cols: must not decrease");
    const int32_t* r = ranks.data_ptr<int32_t>();
    for (int64_t i = 0; i < S * slices; ++i)
        TORCH_CHECK_VALUE(r[i] >= 0 && r[i] <= R, "lora ranks: ", r[i], " not in [0, ", R, "]");
    return {a.data_ptr(), b.data_ptr(), r, c, S, slices, R, K, N, dtype_code(a.scalar_type())};
}

// A step's adapter slot per row: int32 [m], each -1 (none) or a slot of `slots`.
inline const int32_t* check_lora_rows(const Tensor& rows, int64_t m, int64_t slots) {
    check_flat(rows, at::kInt, m, "lora rows");
    const int32_t* p = rows.data_ptr<int32_t>();
    for (int64_t t = 0; t < m; ++t)
        TORCH_CHECK_INDEX(p[t] >= -1 && p[t] < slots, "lora rows: slot ", p[t], " outside the ",
                          slots, " slots");
    return p;
}

// ---- the layer stack in one call (stack.cpp) ----
// A weight given as (format, tensor): float32 panels (kWF32; `rows_f32`: float32 rows instead,
// the embeddings) or a packed WFormat, checked for [n, k] (a gated pair: n each).
inline weir::StackWeight stack_weight(int64_t format, const Tensor& t, int64_t n, int64_t k, bool gated,
                               const char* name, bool rows_f32 = false) {
    if (format == weir::kWF32) {
        if (rows_f32)
            check_flat(t, at::kFloat, n * k, name);
        else
            check_flat(t, at::kFloat, weir::gemm_packed_size(n, k, gated), name);
        return {weir::kWF32, t.data_ptr<float>(), n};
    }
    TORCH_CHECK_VALUE(weir::wformat_known(int(format)), name, ": unknown format ", format);
    TORCH_CHECK_VALUE(k % weir::wformat_block(int(format)) == 0, name, ": k ", k,
                      " is not whole blocks of its format");
    check_flat(t, at::kByte, weir::wpacked_size(int(format), n, k, gated), name);
    return {int(format), t.data_ptr<uint8_t>(), n};
}

}  // namespace weir_ops
