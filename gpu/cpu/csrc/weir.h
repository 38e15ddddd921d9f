// weir's CPU kernels: every function the sources define for another source or for the torch
// operators (ops.cpp), declared once, here.
//
// The kernel sources include no torch header (they compile in about a second, with
// -march=native and -ffast-math); ops.cpp alone does: it registers the torch operators
// (torch.ops.weir.*), checks every tensor it is given (dtype, device, shape, layout) and calls
// these functions with raw pointers. A definition that drifts from its declaration here does not
// link, and Python never passes a pointer: a wrong argument is an exception, never memory
// corruption.

#pragma once

#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace weir {

// ---- the thread pool (pool.cpp) ----
// An OpenMP parallel loop ends at a barrier every thread of the team must reach, so when the OS
// deschedules one of them (another process needs the core: on a 2-core box the HTTP server and
// the client) the others wait out its time slice, at every op of a step. Here the loop's tasks
// are claimed one at a time from a shared counter by whichever threads are running, the caller
// included, and the call returns as soon as every task has run: a thread that wakes late finds
// nothing left and costs nothing. Idle workers spin briefly (the gap between two ops of a step),
// then sleep.

// Runs fn(ctx, task) for every task in [0, tasks), on at most `threads` threads (the caller is
// one of them), and returns when all have run. One loop at a time: a call made while another
// thread's loop is running runs its tasks on the caller alone.
void parallel_for(int64_t tasks, int64_t threads, void (*fn)(void*, int64_t), void* ctx);

template <typename F>
void parallel_for(int64_t tasks, int64_t threads, F&& f) {
    using Fn = std::remove_reference_t<F>;
    parallel_for(tasks, threads, [](void* c, int64_t t) { (*static_cast<Fn*>(c))(t); },
                 static_cast<void*>(&f));
}

// A spin-wait's pause.
inline void relax_cpu() {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

// The calling thread's index in the pool: 0 for the caller of a loop, 1.. for workers (for
// per-thread scratch space).
int thread_index();

// For the tests: runs `tasks` tasks on `threads` threads; each task adds one to runs[task]
// (atomically: a task run twice counts 2) and writes by[task] = 1 + the index of the thread
// that ran it. With `hold`, the caller's first task waits until a worker has started a task, so
// a worker always runs one, and a task on a worker sleeps `worker_us` (a worker taken off its
// core mid-task: the caller's wait outlasts its spin and it sleeps until woken). `hold` needs
// threads >= 2 and tasks >= 2 (the loop then runs on the pool).
void pool_selftest(int64_t tasks, int64_t threads, bool hold, int64_t worker_us, int32_t* runs,
                   int32_t* by);

// ---- element types of attention and the K/V cache ----
// FP8: caches only
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFp8E5M2 = 3, kFp8E4M3 = 4 };

// ---- RMSNorm and rotary embedding (norm_rope.cpp) ----
// x: rows of `dim` floats, row r at x + (r / heads) * token_stride + (r % heads) * dim (a
// [tokens, heads, dim] view whose token stride may be wider, as in a fused QKV output); out:
// contiguous [tokens * heads, dim]. weight: [dim] or null (no norm). cos, sin: [tokens, dim] or
// null (no rotation), the "rotate half" form transformers uses. At least one of weight and cos.
void rms_norm_rope(const float* x, int64_t tokens, int64_t heads, int64_t dim,
                   int64_t token_stride, const float* weight, float eps, const float* cos,
                   const float* sin, float* out, int64_t num_threads);

// A layer norm: each of `rows` rows of `dim` floats (row r at x + r * stride) less its mean,
// over the root of its variance plus eps, times weight [dim], plus bias [dim] (null: none,
// Cohere's); out: contiguous [rows, dim].
void layer_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight,
                const float* bias, float eps, float* out, int64_t num_threads);

// ---- matrix products on packed weights (gemm.cpp) ----
// Activations of a gated pair: the gated code of gemm and pack.
enum Gated : int { kPlain = 0, kSilu = 1, kGelu = 2, kGeluTanh = 3 };
// relu(v)^2: an ungated MLP's activation (Arcee's), applied by the stack after a plain product
// (forward.cpp), never a gated pair's
constexpr int kRelu2 = 4;
// xIELU (Apertus's), its four per-layer constants [softplus(alpha_p), beta + softplus(alpha_n),
// beta, eps]: v > 0 ? a_p v^2 + beta v : (expm1(min(v, eps)) - v) a_n + beta v
constexpr int kXielu = 5;

// x[0, n) through an ungated MLP's activation `act` (kSilu .. kXielu; `params`: xIELU's four
// constants, else unread), in place: the one compiled loop both the layer stack and the module
// path (torch.ops.weir.activate_) run, so they give the same bits.
void activate_rows(float* x, int64_t n, int act, const float* params, int64_t num_threads);

// The packed size in floats of an [n, k] weight (of a gated pair: n = the width of each half).
int64_t gemm_packed_size(int64_t n, int64_t k, bool gated);

// w: [n, k] row-major (a gated pair: gate w and up w2, each [n, k]). Writes the packed form.
void gemm_pack(const float* w, const float* w2, int64_t n, int64_t k, bool gated,
               float* packed);

// out[m, n] = x[m, k] @ W^T (+ bias[n]) (+ residual[m, n]), or, gated, act(x G^T) * (x U^T),
// where a gated pair's residual, when given, is an addend [m, 2n] before the activation: act(x
// G^T + residual[:, :n]) * (x U^T + residual[:, n:]) (LoRA's deltas). residual may be out
// itself (not gated). Strides are in floats between rows.
void gemm(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
          int gated, const float* bias, const float* residual, int64_t res_stride, float* out,
          int64_t out_stride, int64_t num_threads);

// ---- paged attention (attention.cpp) ----
// query/out [tokens, heads, dim] of `dtype`; caches [blocks, block_size, kv_heads, dim] of
// `cache_dtype` (the query's, 16-bit under a float32 query, or FP8 under any);
// block_tables [seqs, max_blocks];
// query_start [seqs + 1]; seq_lens [seqs]; softcap: Gemma 2's cap on the scores (0: none);
// sinks: gpt-oss's [heads] float32 logits, each in its head's softmax sums only (null: none).
// Returns 0, or -1 for a dtype pair not offered.
int paged_attention(const void* query, const void* k_cache, const void* v_cache, void* out,
                    const int32_t* block_tables, const int32_t* query_start,
                    const int32_t* seq_lens, int64_t num_seqs, int64_t max_blocks,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, int64_t sliding_window, int64_t num_threads,
                    int dtype, int cache_dtype, float softcap = 0.f,
                    const float* sinks = nullptr);

// src [n] rounded into dst [n] of `cache_dtype` as the forward writes K/V (forward.cpp): the
// rounding torch's .to() does, tested against it.
void round_to_cache(const float* src, int64_t n, int cache_dtype, void* dst);

// ---- sampling (sample.cpp, mask.cpp) ----
// out[r] = the index torch.argmax gives for row r (first of equal maxima; NaN above all).
void argmax(const float* logits, int64_t rows, int64_t cols, int64_t stride, int64_t* out,
            int64_t num_threads);

// -inf on every logit of rows[r] whose bit in mask row r ([num_rows, words] int32) is clear.
void apply_token_bitmask(float* logits, int64_t row_stride, const int64_t* rows,
                         int64_t num_rows, const int32_t* mask, int64_t words, int64_t vocab,
                         int64_t num_threads);

// ---- weights in 16-bit and block formats (quant.cpp; quant_avx512.cpp, quant_avx2.cpp) ----
// Formats by ggml's type ids (gpu/quant/formats.py). A weight [n, k] is held in weir's panels of
// kPanel output columns, each panel's bytes in k order: for 16-bit formats k pairs of each column
// side by side; for block formats, per 32 weights of k (and per 256 for the k-quants' headers),
// every column's scales, then its integers laid out for a 4-byte-per-lane integer dot product.
enum WFormat : int {
    kWF16 = 1,
    kWQ4_0 = 2,
    kWQ4_1 = 3,
    kWQ5_0 = 6,
    kWQ5_1 = 7,
    kWQ8_0 = 8,
    kWQ2_K = 10,
    kWQ3_K = 11,
    kWQ4_K = 12,
    kWQ5_K = 13,
    kWQ6_K = 14,
    kWIQ2_XXS = 16,  // weir's transcodings (gpu/quant/iq_grids.py): IQ4_XS's layout
    kWIQ2_XS = 17,   // IQ2_XS, IQ2_S: 4-bit indices, an int8 scale per 16 (Q6_K's scales)
    kWIQ3_XXS = 18,
    kWIQ4_NL = 20,
    kWIQ3_S = 21,
    kWIQ2_S = 22,
    kWIQ4_XS = 23,
    kWBF16 = 30,
    kWMXFP4 = 39,  // held as IQ4_NL's block with its own table: f16 d = 2^(e - 128), 4-bit codes
};
constexpr int64_t kPanel = 16;

// The kernels for a product: the portable reference, AVX2, AVX-512 (with VNNI and BF16 where the
// CPU has them). kPathAuto: the best this CPU runs.
enum QPath : int { kPathAuto = 0, kPathRef = 1, kPathAvx2 = 2, kPathAvx512 = 3 };

// Whether `format` is one of the above, and whether this CPU runs `path`.
bool wformat_known(int format);
bool qpath_available(int path);
int qpath_best();

// The bytes of GGUF's rows of k weights (k a multiple of the format's block), and of weir's packed
// form of an [n, k] weight (of a gated pair: n = the width of each half).
int64_t wformat_row_bytes(int format, int64_t k);
int64_t wformat_block(int format);  // k must be a multiple of this: 256, 32, or 2 (16-bit)
int64_t wpacked_size(int format, int64_t n, int64_t k, bool gated);

// GGUF rows [n][row_bytes] -> weir's panels (n padded to panels with zero weights); a gated pair,
// gate rows and up rows2, as alternate panels.
void wpack(int format, const uint8_t* rows, const uint8_t* rows2, int64_t n, int64_t k,
           uint8_t* packed, int64_t num_threads);

// The float weights [n, k] a packed (plain) weight stands for: exactly the GGUF dequantization.
void wdequant(int format, const uint8_t* packed, int64_t n, int64_t k, float* out);

// Rows rows[0..count) of a packed (plain) weight, dequantized into out[count, k]: an embedding
// table's lookup (rows checked by the caller).
void wgather(int format, const uint8_t* packed, int64_t k, const int64_t* rows, int64_t count,
             float* out, int64_t num_threads);

// out[m, n] = x[m, k] @ W^T (+ bias) (+ residual) on a packed weight, or, gated (kSilu...),
// act(x G^T) * (x U^T) (a gated pair's residual: an addend [m, 2n] before the activation, as
// gemm's). Block formats quantize each row of x to int8 per 32 (scale amax / 127)
// and take integer dot products; BF16 takes x rounded to bfloat16, F16 x as it is. Each output is
// the same sum in the same order whatever the batch and the path. residual may be out itself;
// strides in floats between rows.
void wgemm(int format, const float* x, int64_t m, int64_t k, int64_t x_stride,
           const uint8_t* packed, int64_t n, int gated, const float* bias, const float* residual,
           int64_t res_stride, float* out, int64_t out_stride, int64_t num_threads, int path);

// Weights sharing an input, each its own packed format, their outputs side by side (Q, K and V
// of a Q4_K_M file: V in Q6_K): one pass over the threads, the input converted once per form
// (int8 blocks, bfloat16), where one wgemm a part paid each time for its dispatch and the
// threads' ramp onto a few hundred KB. Each part's outputs are what wgemm gives it, bit for bit.
// bias and residual as wgemm's, over all the parts' outputs [m, sum of n]; no gated part.
struct WPart {
    int format;
    const uint8_t* packed;
    int64_t n;
};
void wgemm_parts(const WPart* parts, int count, const float* x, int64_t m, int64_t k,
                 int64_t x_stride, const float* bias, const float* residual, int64_t res_stride,
                 float* out, int64_t out_stride, int64_t num_threads, int path);

// A mixture's experts in one pass of the threads: expert i's rows of x are [segments[i],
// segments[i + 1]) (x's rows ordered by expert), its outputs those rows of out [rows, n]; each
// row's outputs are what wgemm gives it on its expert's weight, bit for bit. gated: each expert
// a gated pair (kSilu...). The input is converted once for all the experts' rows.
void wgemm_experts(const WPart* experts, int count, const int64_t* segments, const float* x,
                   int64_t k, int64_t x_stride, int gated, float* out, int64_t out_stride,
                   int64_t num_threads, int path);

// ---- LoRA adapters (lora.cpp) ----
// One product group's adapters, held in slots (gpu/lora.py): per slot and slice (Q, K and V of
// the Q/K/V product; gate and up), A [rank, k] as the first rows of a [max_rank, k] block, and
// B^T [rank, the slice's columns] (the adapter's scaling folded in) in that slice's columns of
// the slot's [max_rank, n] block; each slice's rank, 0 where the adapter leaves it alone. A and
// B are float32 or bfloat16 (--lora-dtype; widened to float32 as they are read).
constexpr int64_t kLoraMaxRank = 512;
struct LoraGroup {
    const void* a;         // [slots, slices, max_rank, k]
    const void* b;         // [slots, max_rank, n]
    const int32_t* ranks;  // [slots, slices], each in [0, max_rank]
    const int64_t* cols;   // [slices + 1]: each slice's first output column, then n
    int64_t slots, slices, max_rank, k, n;
    int dtype;  // of a and b: kFloat32 or kBFloat16
};

// y[t, cols of slice s] += (x[t] A_s^T) B_s^T for the adapter in slot row_slot[t] ([m]); a row
// whose slot is -1 is not touched. Strides in floats between rows (y may be a residual stream).
// With `assign`, y = the deltas instead, zeros in rows without an adapter and in slices their
// adapter leaves alone. Returns false, having written nothing, when no row's adapter modifies
// the group.
bool lora_add(const LoraGroup& g, const float* x, int64_t m, int64_t x_stride,
              const int32_t* row_slot, float* y, int64_t y_stride, int64_t num_threads,
              bool assign = false);

// The layer stack in one call (forward.cpp, moe.cpp): its model, layers and step, decoder.h.

}  // namespace weir
