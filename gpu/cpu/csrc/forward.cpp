// The decoder's layers in one call: every layer of a CPU float32 forward without returning to
// Python between its steps. The K/V cache may be float32 or 16-bit (--kv-cache-dtype).
//
// The same kernels the modules call one by one (cpu_norm_rope.cpp, cpu_gemm.cpp,
// cpu_attention.cpp), called in the same order on the same buffers, so the result is bitwise
// the module path's (tests/test_cpu_forward.py); what goes is the interpreter between them: a
// dozen torch ops and ctypes calls per layer, each 5-20 us, which at one stream cost as much
// as the layer's arithmetic (issue 22). K and V are written into the paged cache here too.
//
// Per layer, x the residual stream [tokens, hidden], updated in place:
//   h = rms_norm(x); qkv = h Wqkv^T (+ b); q = rope(norm(q)); k = rope(norm(k)) -> cache;
//   v -> cache; o = attention(q, cache); x += o Wo^T; h = rms_norm(x); g = act(h G^T) * (h U^T);
//   x += g Wd^T
// then out = rms_norm(x) with the final norm, and, when asked, the LM head's logits of chosen
// rows of out: here rather than as a call of its own after the return, when weir's pool threads
// have gone back to sleep and the caller did most of that product alone (64-row decode step:
// 0.85 ms for 123 MFLOP, one core's rate).

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>

#include "attention_simd.h"

extern "C" {
void weir_rms_norm_rope(const float* x, int64_t tokens, int64_t heads, int64_t dim,
                        int64_t token_stride, const float* weight, float eps, const float* cos,
                        const float* sin, float* out, int64_t num_threads);
void weir_gemm(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed,
               int64_t n, int gated, const float* bias, const float* residual,
               int64_t res_stride, float* out, int64_t out_stride, int64_t num_threads);
int weir_paged_attention(const void* query, const void* k_cache, const void* v_cache, void* out,
                         const int32_t* block_tables, const int32_t* query_start,
                         const int32_t* seq_lens, int64_t num_seqs, int64_t max_blocks,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t sliding_window,
                         int64_t num_threads, int dtype, int cache_dtype);
}

namespace {

// Field order and types mirror gpu/cpu/forward.py's ctypes Structures.
struct Layer {
    const float* input_norm;  // [hidden]
    const float* post_norm;   // [hidden]
    const float* qkv;         // packed [q + 2 kv outputs, hidden]
    const float* qkv_bias;    // or null
    const float* q_norm;      // [head_dim] or null (no Q/K norm)
    const float* k_norm;
    const float* o;           // packed [hidden, heads * head_dim]
    const float* gate_up;     // packed gated pair [intermediate, hidden] x 2
    const float* down;        // packed [hidden, intermediate]
    void* k_cache;            // [blocks, block_size, kv_heads, head_dim], of Model::cache_dtype
    void* v_cache;
};

struct Model {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_layers;
    int64_t block_size, sliding_window;
    float eps, scale;
    int64_t act;  // cpu_gemm.cpp's gated code: 1 SiLU, 2 GELU, 3 GELU (tanh)
    int64_t cache_dtype;  // the K/V cache's elements: 0 float32, 1 bfloat16, 2 float16
    const Layer* layers;
    const float* final_norm;
    const float* lm_head;  // packed [vocab, hidden] (cpu_gemm.cpp), or null: no logits here
    int64_t vocab;
};

struct Step {
    int64_t tokens;
    float* x;            // [tokens, hidden] scratch: the embeddings, then the residual stream
    float* out;          // [tokens, hidden], the final norm of x
    const int64_t* slots;  // [tokens], -1: write nothing
    const int32_t* block_tables;
    int64_t max_blocks;
    const int32_t* query_start;
    const int32_t* seq_lens;
    int64_t num_seqs;
    int64_t num_threads;
    // x starts as the rows input_ids of embed [vocab, hidden]; each token's rotary rows are
    // the rows positions of cos_table / sin_table [table_rows, head_dim]: the step's gathers
    // here instead of as torch ops from Python (tens of us a step at one row).
    const int64_t* input_ids;
    const float* embed;
    int64_t vocab;
    const int64_t* positions;
    const float* cos_table;
    const float* sin_table;
    int64_t table_rows;
    // logits [num_logits, vocab] of out's rows logits_rows (null: rows 0..num_logits-1);
    // logits null: none
    const int64_t* logits_rows;
    int64_t num_logits;
    float* logits;
};

// Seconds spent in each kind of op since the last weir_forward_profile call, kept only while
// weir_forward_profile(nullptr, 1) has switched it on (benchmarks: the breakdown of a step).
enum Op { kNorm, kQkv, kRope, kKv, kAttention, kOut, kGateUp, kDown, kLogits, kOps };
bool profiling = false;
double spent[kOps] = {};

struct Timer {
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    void lap(Op op) {
        if (!profiling) return;
        const auto t1 = std::chrono::steady_clock::now();
        spent[op] += std::chrono::duration<double>(t1 - t0).count();
        t0 = t1;
    }
};

// Rows of `width` floats into their cache slots (rounded as torch's .to() rounds for a 16-bit
// cache); slot -1 writes nothing.
template <typename C>
void scatter_as(void* cache, const float* rows, int64_t row_stride, const int64_t* slots,
                int64_t tokens, int64_t width) {
    C* c = static_cast<C*>(cache);
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= 0) narrow(rows + t * row_stride, width, c + slots[t] * width);
}

void scatter(int64_t dtype, void* cache, const float* rows, int64_t row_stride,
             const int64_t* slots, int64_t tokens, int64_t width) {
    if (dtype == 1) return scatter_as<uint16_t>(cache, rows, row_stride, slots, tokens, width);
    if (dtype == 2) return scatter_as<_Float16>(cache, rows, row_stride, slots, tokens, width);
    scatter_as<float>(cache, rows, row_stride, slots, tokens, width);
}

}  // namespace

extern "C" {

int weir_decoder_forward(const Model* m, const Step* s) {
    const int64_t T = s->tokens, H = m->hidden, D = m->head_dim, nt = s->num_threads;
    const int64_t qw = m->heads * D, kvw = m->kv_heads * D, qkvw = qw + 2 * kvw;
    const int64_t I = m->intermediate;
    if (T == 0) return 0;
    std::unique_ptr<float[]> buf(new float[T * (H + qkvw + qw + kvw + qw + I + 2 * D)]);
    float* cos = buf.get() + T * (H + qkvw + qw + kvw + qw + I);
    float* sin = cos + T * D;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t id = s->input_ids[t], p = s->positions[t];
        if (id < 0 || id >= s->vocab) return 2;       // a token id outside the vocabulary
        if (p < 0 || p >= s->table_rows) return 3;     // past the rotary table
        std::memcpy(s->x + t * H, s->embed + id * H, sizeof(float) * H);
        std::memcpy(cos + t * D, s->cos_table + p * D, sizeof(float) * D);
        std::memcpy(sin + t * D, s->sin_table + p * D, sizeof(float) * D);
    }
    float* h = buf.get();
    float* qkv = h + T * H;
    float* q = qkv + T * qkvw;
    float* k = q + T * qw;
    float* o = k + T * kvw;
    float* g = o + T * qw;
    float* x = s->x;
    Timer timer;
    for (int64_t i = 0; i < m->num_layers; ++i) {
        const Layer& L = m->layers[i];
        weir_rms_norm_rope(x, T, 1, H, H, L.input_norm, m->eps, nullptr, nullptr, h, nt);
        timer.lap(kNorm);
        weir_gemm(h, T, H, H, L.qkv, qkvw, 0, L.qkv_bias, nullptr, 0, qkv, qkvw, nt);
        timer.lap(kQkv);
        const float eps = L.q_norm ? m->eps : 0.f;
        weir_rms_norm_rope(qkv, T, m->heads, D, qkvw, L.q_norm, eps, cos, sin, q, nt);
        weir_rms_norm_rope(qkv + qw, T, m->kv_heads, D, qkvw, L.k_norm, eps, cos, sin, k,
                           nt);
        timer.lap(kRope);
        scatter(m->cache_dtype, L.k_cache, k, kvw, s->slots, T, kvw);
        scatter(m->cache_dtype, L.v_cache, qkv + qw + kvw, qkvw, s->slots, T, kvw);
        timer.lap(kKv);
        const int rc = weir_paged_attention(q, L.k_cache, L.v_cache, o, s->block_tables,
                                            s->query_start, s->seq_lens, s->num_seqs,
                                            s->max_blocks, m->heads, m->kv_heads, D,
                                            m->block_size, m->scale, m->sliding_window, nt, 0,
                                            int(m->cache_dtype));
        if (rc != 0) return rc;
        timer.lap(kAttention);
        weir_gemm(o, T, qw, qw, L.o, H, 0, nullptr, x, H, x, H, nt);
        timer.lap(kOut);
        weir_rms_norm_rope(x, T, 1, H, H, L.post_norm, m->eps, nullptr, nullptr, h, nt);
        timer.lap(kNorm);
        weir_gemm(h, T, H, H, L.gate_up, I, int(m->act), nullptr, nullptr, 0, g, I, nt);
        timer.lap(kGateUp);
        weir_gemm(g, T, I, I, L.down, H, 0, nullptr, x, H, x, H, nt);
        timer.lap(kDown);
    }
    weir_rms_norm_rope(x, T, 1, H, H, m->final_norm, m->eps, nullptr, nullptr, s->out, nt);
    timer.lap(kNorm);
    if (s->logits && m->lm_head && s->num_logits > 0) {
        const float* rows = s->out;
        if (s->logits_rows) {  // the sampled rows, gathered (h is free again)
            if (s->num_logits > T) return 4;
            for (int64_t r = 0; r < s->num_logits; ++r) {
                const int64_t row = s->logits_rows[r];
                if (row < 0 || row >= T) return 4;
                std::memcpy(h + r * H, s->out + row * H, sizeof(float) * H);
            }
            rows = h;
        } else if (s->num_logits > T) {
            return 4;
        }
        weir_gemm(rows, s->num_logits, H, H, m->lm_head, m->vocab, 0, nullptr, nullptr, 0,
                  s->logits, m->vocab, nt);
        timer.lap(kLogits);
    }
    return 0;
}

// Copies the seconds per op kind (norm, qkv, rope, kv write, attention, o, gate/up, down, lm head) into
// out (when given) and zeroes them; enable switches the timing on or off.
void weir_forward_profile(double* out, int enable) {
    if (out) std::memcpy(out, spent, sizeof spent);
    std::memset(spent, 0, sizeof spent);
    profiling = enable != 0;
}

}  // extern "C"
