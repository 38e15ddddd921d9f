// The decoder's layers in one call: every layer of a CPU forward (float32 activations; weights
// in float32, 16-bit or GGUF block formats) without returning to Python between its steps. The
// K/V cache may be float32, 16-bit or FP8 (--kv-cache-dtype).
//
// The same kernels the modules call one by one (norm_rope.cpp, gemm.cpp, quant.cpp,
// attention.cpp), called in the same order on the same buffers, so the result is bitwise the
// module path's (tests/test_cpu_forward.py; a mixture of experts' routing aside, moe.cpp); what
// goes is the interpreter between them: a dozen torch ops and kernel calls per layer, which at
// one stream cost as much as the layer's arithmetic. K and V are written into the cache here too.
//
// Per layer, x the residual stream [tokens, hidden], updated in place:
//   h = rms_norm(x); qkv = h Wqkv^T (+ b); q = rope(norm(q)); k = rope(norm(k)) -> cache;
//   v -> cache; o = attention(q, cache (+ sinks)); x += o Wo^T (+ b); h = rms_norm(x);
//   g = act(h G^T) * (h U^T) (an ungated MLP: act(h U^T + b)); x += g Wd^T (+ b)
// (Cohere: every norm mean-centred, and no second norm: the MLP reads h, and x gains both
// blocks' outputs, attention's first, as transformers adds them; OLMo: Q/K/V clipped)
// (Granite: o and g times its residual factor before their products, which is the factor on
// the blocks' outputs, neither product having a bias)
// (a mixture of experts in place of the last three: moe.cpp, with Qwen2-MoE's shared expert
// computed here: shared_expert), then out = rms_norm(x) with the final norm, and, when asked,
// the LM head's logits of chosen rows of out: here rather than as a call of its own after the
// return, when weir's pool threads have gone back to sleep and the caller did most of that
// product alone, at one core's rate.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "activation.h"
#include "attention_simd.h"
#include "decoder.h"

namespace {

using weir::DecoderModel;
using weir::DecoderStep;
using weir::ProfileOp;

// Seconds spent in each kind of op since the last forward_profile call, kept only while
// forward_profile(nullptr, true) has switched it on (benchmarks: the breakdown of a step).
bool profiling = false;
double spent[weir::kOps] = {};

struct Timer {
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    void lap(ProfileOp op) {
        if (!profiling) return;
        const auto t1 = std::chrono::steady_clock::now();
        spent[op] += std::chrono::duration<double>(t1 - t0).count();
        t0 = t1;
    }
};

// The model's norm of x [T, H] into out: RMSNorm, or a layer norm (Cohere's; Nemotron's, with
// a bias).
void model_norm(const DecoderModel* m, const float* x, int64_t T, int64_t H, const float* weight,
                const float* bias, float* out, int64_t nt) {
    if (m->layer_norm) return weir::layer_norm(x, T, H, H, weight, bias, m->eps, out, nt);
    weir::rms_norm_rope(x, T, 1, H, H, weight, m->eps, nullptr, nullptr, out, nt);
}

// Rows of `width` floats into their cache slots (rounded as torch's .to() rounds for a 16-bit
// or FP8 cache); slot -1 writes nothing.
// x[0, n) times f (Granite's residual factor on a block's last product's input; 1: nothing)
void scale_rows(float* x, int64_t n, float f) {
    if (f != 1.f)
        for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

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
    if (dtype == 3) return scatter_as<Fp8E5M2>(cache, rows, row_stride, slots, tokens, width);
    if (dtype == 4) return scatter_as<Fp8E4M3>(cache, rows, row_stride, slots, tokens, width);
    scatter_as<float>(cache, rows, row_stride, slots, tokens, width);
}

using weir::StackLinear;
using weir::StackWeight;

// out = x W^T (+ bias) (+ residual) on one part, by its format.
void part_product(const StackWeight& w, const float* x, int64_t m, int64_t k, int64_t x_stride,
                  int gated, const float* bias, const float* residual, int64_t res_stride,
                  float* out, int64_t out_stride, int64_t nt) {
    if (w.format == weir::kWF32)
        weir::gemm(x, m, k, x_stride, static_cast<const float*>(w.data), w.n, gated, bias,
                   residual, res_stride, out, out_stride, nt);
    else
        weir::wgemm(w.format, x, m, k, x_stride, static_cast<const uint8_t*>(w.data), w.n, gated,
                    bias, residual, res_stride, out, out_stride, nt, weir::kPathAuto);
}

// A product over a StackLinear: its parts' outputs side by side; gated with two parts, gate and
// up each a plain product (`spare`: [m, n] scratch for up) and act(gate) * up.
void product(const StackLinear& w, const float* x, int64_t m, int64_t k, int gated,
             const float* bias, const float* residual, int64_t res_stride, float* out,
             int64_t out_stride, int64_t nt, float* spare) {
    if (w.parts == 1)
        return part_product(w.part[0], x, m, k, k, gated, bias, residual, res_stride, out,
                            out_stride, nt);
    if (gated) {  // residual: a pre-activation addend [m, 2n], gate's then up's
        const int64_t n = w.part[0].n;
        part_product(w.part[0], x, m, k, k, 0, nullptr, residual, res_stride, out, out_stride,
                     nt);
        part_product(w.part[1], x, m, k, k, 0, nullptr, residual ? residual + n : nullptr,
                     res_stride, spare, n, nt);
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j)
                out[r * out_stride + j] = weir::activate(gated, out[r * out_stride + j]) * spare[r * n + j];
        return;
    }
    bool packed = true;  // every part in a wpack format: one pass for all
    for (int i = 0; i < w.parts; ++i) packed &= w.part[i].format != weir::kWF32;
    if (packed) {
        weir::WPart parts[3];
        for (int i = 0; i < w.parts; ++i)
            parts[i] = {w.part[i].format, static_cast<const uint8_t*>(w.part[i].data), w.part[i].n};
        return weir::wgemm_parts(parts, w.parts, x, m, k, k, bias, residual, res_stride, out,
                                 out_stride, nt, weir::kPathAuto);
    }
    int64_t off = 0;
    for (int i = 0; i < w.parts; ++i) {
        part_product(w.part[i], x, m, k, k, 0, bias ? bias + off : nullptr,
                     residual ? residual + off : nullptr, res_stride, out + off, out_stride, nt);
        off += w.part[i].n;
    }
}

// Gemma 3's block output: x += rms_norm(in W^T) with `norm` (out, normed: [m, n] scratch), the
// module path's product, norm and add.
void sandwich(const StackLinear& w, const float* in, int64_t m, int64_t k, int64_t n,
              const float* norm, float eps, float* x, float* out, float* normed, int64_t nt,
              float* spare) {
    product(w, in, m, k, 0, nullptr, nullptr, 0, out, n, nt, spare);
    weir::rms_norm_rope(out, m, 1, n, n, norm, eps, nullptr, nullptr, normed, nt);
    for (int64_t i = 0; i < m * n; ++i) x[i] = x[i] + normed[i];
}

// Qwen2-MoE's shared expert for moe_block to add: y [T, H] = down(act(gate(h)) * up(h)) and
// each token's gate logit [T] = h Wg^T (g, spare: [T, S] scratch).
void shared_expert(const weir::DecoderLayer& L, const float* h, int64_t T, int64_t H, int act,
                   float* g, float* spare, float* y, float* logit, int64_t nt) {
    const int64_t S = L.shared_intermediate;
    part_product(L.shared_gate, h, T, H, H, 0, nullptr, nullptr, 0, logit, 1, nt);
    product(L.gate_up, h, T, H, act, nullptr, nullptr, 0, g, S, nt, spare);
    product(L.down, g, T, S, 0, nullptr, nullptr, 0, y, H, nt, spare);
}

// Rows input_ids of the embeddings into x [tokens, hidden].
void embed_rows(const StackWeight& e, const int64_t* ids, int64_t tokens, int64_t hidden,
                float* x, int64_t nt) {
    if (e.format == weir::kWF32) {
        const float* rows = static_cast<const float*>(e.data);
        for (int64_t t = 0; t < tokens; ++t)
            std::memcpy(x + t * hidden, rows + ids[t] * hidden, sizeof(float) * hidden);
        return;
    }
    weir::wgather(e.format, static_cast<const uint8_t*>(e.data), hidden, ids, tokens, x, nt);
}

}  // namespace

namespace weir {

int decoder_forward(const DecoderModel& model, const DecoderStep& step) {
    const DecoderModel* m = &model;
    const DecoderStep* s = &step;
    const int64_t T = s->tokens, H = m->hidden, D = m->head_dim, nt = s->num_threads;
    const int64_t qw = m->heads * D, kvw = m->kv_heads * D, qkvw = qw + 2 * kvw;
    const int64_t I = m->intermediate;
    const int64_t G = std::max(I, m->shared_intermediate);  // g's and spare's width
    if (T == 0) return 0;
    // h, qkv, q, k, o, g, the up part's spare [T, G] (gate and up of different formats), cos,
    // sin; with adapters in the step, gate/up's addend [T, 2I]
    const int32_t* lora = s->lora_rows;
    const int64_t lora_floats = lora ? T * 2 * I : 0;
    // (and the second rotation's cos, sin, and a block's output [T, H] before its norm: Gemma 3)
    const bool local = s->cos_local_table != nullptr;
    std::unique_ptr<float[]> buf(
        new float[T * (H + qkvw + qw + kvw + qw + 2 * G + 2 * D) + lora_floats +
                  (local ? 2 * T * D : 0) + 2 * T * H]);
    float* cos = buf.get() + T * (H + qkvw + qw + kvw + qw + 2 * G);
    float* sin = cos + T * D;
    float* cos_l = sin + T * D + lora_floats;
    float* sin_l = local ? cos_l + T * D : cos_l;
    float* block_out = sin_l + (local ? T * D : 0);
    float* block_normed = block_out + T * H;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t id = s->input_ids[t], p = s->positions[t];
        if (id < 0 || id >= m->embed.n) return 2;     // a token id outside the vocabulary
        if (p < 0 || p >= s->table_rows) return 3;     // past the rotary table
        std::memcpy(cos + t * D, s->cos_table + p * D, sizeof(float) * D);
        std::memcpy(sin + t * D, s->sin_table + p * D, sizeof(float) * D);
        if (local) {
            if (p >= s->local_rows) return 3;
            std::memcpy(cos_l + t * D, s->cos_local_table + p * D, sizeof(float) * D);
            std::memcpy(sin_l + t * D, s->sin_local_table + p * D, sizeof(float) * D);
        }
    }
    embed_rows(m->embed, s->input_ids, T, H, s->x, nt);
    if (m->embed_scale != 1.f)
        for (int64_t i = 0; i < T * H; ++i) s->x[i] *= m->embed_scale;
    float* h = buf.get();
    float* qkv = h + T * H;
    float* q = qkv + T * qkvw;
    float* k = q + T * qw;
    float* o = k + T * kvw;
    float* g = o + T * qw;
    float* spare = g + T * G;
    float* dgu = cos + 2 * T * D;  // LoRA's scratch, after sin
    float* x = s->x;
    // a mixture of experts' scratch (moe.cpp), for the largest of the model's mixtures
    const int64_t E = m->moe_experts, pairs = T * m->moe_top_k;
    std::unique_ptr<float[]> moe_f;
    std::unique_ptr<int64_t[]> moe_i;
    std::unique_ptr<int32_t[]> moe_c;
    MoeScratch moe{};
    if (E) {
        moe_f.reset(new float[T * E + pairs + pairs * (2 * H + m->moe_intermediate)]);
        moe_i.reset(new int64_t[pairs + E + 1]);
        moe_c.reset(new int32_t[pairs]);
        moe = {moe_f.get(), moe_f.get() + T * E, moe_c.get(), moe_i.get(), moe_i.get() + pairs,
               moe_f.get() + T * E + pairs, nullptr, nullptr};
        moe.gated = moe.rows + pairs * H;
        moe.outs = moe.gated + pairs * m->moe_intermediate;
    }
    Timer timer;
    for (int64_t i = 0; i < m->num_layers; ++i) {
        const DecoderLayer& L = m->layers[i];
        const float* hin = L.input_norm ? h : x;  // OLMo 2: no norm before attention
        if (L.input_norm) model_norm(m, x, T, H, L.input_norm, L.input_norm_bias, h, nt);
        timer.lap(kNorm);
        // Adapters' deltas: added to Q/K/V's output ((x W^T + b) + delta, as a residual would
        // be), into the residual stream before the O and down products add theirs, and as
        // gate/up's pre-activation addend (written whole, or none when no adapter of the step
        // modifies gate or up); rows without an adapter add nothing.
        product(L.qkv, hin, T, H, 0, L.qkv_bias, nullptr, 0, qkv, qkvw, nt, spare);
        if (lora && L.lora[kLoraQkv].a) lora_add(L.lora[kLoraQkv], hin, T, H, lora, qkv, qkvw, nt);
        const float clip = m->qkv_clip;  // OLMo's clip_qkv (0: none)
        if (clip > 0.f)
            for (int64_t i = 0; i < T * qkvw; ++i) qkv[i] = std::clamp(qkv[i], -clip, clip);
        timer.lap(kQkv);
        const float eps = L.q_norm ? m->eps : 0.f;
        const float* c = L.local_rope && local ? cos_l : cos;
        const float* sn = L.local_rope && local ? sin_l : sin;
        if (L.qk_whole) {  // OLMo's: each token's Q (and K) normalized whole, then turned
            rms_norm_rope(qkv, T, 1, qw, qkvw, L.q_norm, eps, nullptr, nullptr, q, nt);
            rms_norm_rope(qkv + qw, T, 1, kvw, qkvw, L.k_norm, eps, nullptr, nullptr, k, nt);
            rms_norm_rope(q, T, m->heads, D, qw, nullptr, 0.f, c, sn, q, nt);
            rms_norm_rope(k, T, m->kv_heads, D, kvw, nullptr, 0.f, c, sn, k, nt);
        } else if (m->norm_after_rope && L.q_norm) {  // Hunyuan's: turned, then normalized
            rms_norm_rope(qkv, T, m->heads, D, qkvw, nullptr, 0.f, c, sn, q, nt);
            rms_norm_rope(qkv + qw, T, m->kv_heads, D, qkvw, nullptr, 0.f, c, sn, k, nt);
            rms_norm_rope(q, T, m->heads, D, qw, L.q_norm, eps, nullptr, nullptr, q, nt);
            rms_norm_rope(k, T, m->kv_heads, D, kvw, L.k_norm, eps, nullptr, nullptr, k, nt);
        } else {
            rms_norm_rope(qkv, T, m->heads, D, qkvw, L.q_norm, eps, c, sn, q, nt);
            rms_norm_rope(qkv + qw, T, m->kv_heads, D, qkvw, L.k_norm, eps, c, sn, k, nt);
        }
        if (m->q_beta != 0.f)  // Ministral 3's temperature, as gpu/models/query_scale.py's
            for (int64_t t = 0; t < T; ++t) {
                const float blocks = std::floor(float(s->positions[t]) / float(m->q_length));
                const float f = 1.f + m->q_beta * std::log(1.f + blocks);
                if (f != 1.f)
                    for (int64_t j = 0; j < qw; ++j) q[t * qw + j] *= f;
            }
        timer.lap(kRope);
        if (L.k_mul != 0.f) {  // a checkpoint's FP8 KV scales: K and V as they are written
            for (int64_t i = 0; i < T * kvw; ++i) k[i] *= L.k_mul;
            for (int64_t t = 0; t < T; ++t) {
                float* v = qkv + t * qkvw + qw + kvw;
                for (int64_t j = 0; j < kvw; ++j) v[j] *= L.v_mul;
            }
        }
        scatter(m->cache_dtype, L.k_cache, k, kvw, s->slots, T, kvw);
        scatter(m->cache_dtype, L.v_cache, qkv + qw + kvw, qkvw, s->slots, T, kvw);
        timer.lap(kKv);
        const float score_scale = L.score_scale != 0.f ? L.score_scale : m->scale;
        const int rc = paged_attention(q, L.k_cache, L.v_cache, o, s->block_tables,
                                            s->query_start, s->seq_lens, s->num_seqs,
                                            s->max_blocks, m->heads, m->kv_heads, D,
                                            m->block_size, score_scale, L.window, nt, 0,
                                            int(m->cache_dtype), m->attn_softcap, L.sinks);
        if (rc != 0) return rc;
        if (L.out_scale != 0.f)
            for (int64_t i = 0; i < T * qw; ++i) o[i] *= L.out_scale;
        scale_rows(o, T * qw, m->residual_scale);  // Granite's factor, on O's input
        timer.lap(kAttention);
        if (L.post_attn_norm) {  // Gemma 3: the block's output normalized, then added
            sandwich(L.o, o, T, qw, H, L.post_attn_norm, m->eps, x, block_out, block_normed, nt,
                     spare);
            timer.lap(kOut);
            if (L.pre_ffn_norm)  // (OLMo 2: none, the MLP reads the stream itself)
                rms_norm_rope(x, T, 1, H, H, L.pre_ffn_norm, m->eps, nullptr, nullptr, h, nt);
            const float* mlp_in = L.pre_ffn_norm ? h : x;
            product(L.gate_up, mlp_in, T, H, int(m->act), nullptr, nullptr, 0, g, I, nt, spare);
            scale_rows(g, T * I, m->residual_scale);
            timer.lap(kGateUp);
            sandwich(L.down, g, T, I, H, L.post_ffn_norm, m->eps, x, block_out, block_normed,
                     nt, spare);
            timer.lap(kDown);
            continue;
        }
        if (lora && L.lora[kLoraO].a) lora_add(L.lora[kLoraO], o, T, qw, lora, x, H, nt);
        product(L.o, o, T, qw, 0, L.o_bias, x, H, x, H, nt, spare);
        timer.lap(kOut);
        if (!m->parallel_block) {  // (Cohere's MLP reads the input norm's h, as attention did)
            model_norm(m, x, T, H, L.post_norm, L.post_norm_bias, h, nt);
            timer.lap(kNorm);
        }
        if (L.experts) {  // a mixture of experts in place of the MLP
            // Qwen2-MoE's shared expert, into the scratch Gemma's blocks would use
            const bool shared = L.shared_gate.data != nullptr;
            if (shared)
                shared_expert(L, h, T, H, int(m->act), g, spare, block_out, block_normed, nt);
            moe_block(L, h, T, H, x, moe, int(m->act), nt, shared ? block_out : nullptr,
                      block_normed, m->residual_scale);
            timer.lap(kDown);
            continue;
        }
        const float* gu_add = nullptr;
        if (lora && L.lora[kLoraGateUp].a &&
            lora_add(L.lora[kLoraGateUp], h, T, H, lora, dgu, 2 * I, nt, /*assign=*/true))
            gu_add = dgu;
        product(L.gate_up, h, T, H, L.plain_up ? 0 : int(m->act), L.up_bias, gu_add, 2 * I, g, I,
                nt, spare);
        if (L.plain_up) activate_rows(g, T * I, int(m->act), L.xielu, nt);  // (an ungated MLP)
        scale_rows(g, T * I, m->residual_scale);
        timer.lap(kGateUp);
        if (lora && L.lora[kLoraDown].a) lora_add(L.lora[kLoraDown], g, T, I, lora, x, H, nt);
        product(L.down, g, T, I, 0, L.down_bias, x, H, x, H, nt, spare);
        timer.lap(kDown);
    }
    model_norm(m, x, T, H, m->final_norm, m->final_norm_bias, s->out, nt);
    timer.lap(kNorm);
    if (s->logits && m->lm_head.data && s->num_logits > 0) {
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
        part_product(m->lm_head, rows, s->num_logits, H, H, 0, nullptr, nullptr, 0, s->logits,
                     m->lm_head.n, nt);
        timer.lap(kLogits);
    }
    return 0;
}

void activate_rows(float* x, int64_t n, int act, const float* params, int64_t num_threads) {
    const int64_t chunk = 16384, tasks = (n + chunk - 1) / chunk;
    parallel_for(tasks, n > 2 * chunk ? num_threads : 1, [&](int64_t task) {
        float* p = x + task * chunk;
        const int64_t len = std::min(chunk, n - task * chunk);
        if (act == kXielu) {
            const float ap = params[0], an = params[1], b = params[2], eps = params[3];
            for (int64_t i = 0; i < len; ++i) {
                const float v = p[i], below = (std::expm1(std::min(v, eps)) - v) * an + b * v;
                p[i] = v > 0.f ? ap * v * v + b * v : below;
            }
            return;
        }
        if (act == kRelu2) {
            for (int64_t i = 0; i < len; ++i) p[i] = p[i] > 0.f ? p[i] * p[i] : 0.f;
            return;
        }
        for (int64_t i = 0; i < len; ++i) p[i] = activate(act, p[i]);
    });
}

void round_to_cache(const float* src, int64_t n, int cache_dtype, void* dst) {
    const int64_t slot = 0;  // one row of n, into the cache's slot 0
    scatter(cache_dtype, dst, src, n, &slot, 1, n);
}

void forward_profile(double* out, bool enable) {
    if (out) std::memcpy(out, spent, sizeof spent);
    std::memset(spent, 0, sizeof spent);
    profiling = enable;
}

}  // namespace weir
