// The decoder's layer stack in one call (forward.cpp; a mixture of experts' block: moe.cpp): the
// model, its layers and a step, as stack.cpp binds them from a model's tensors. Apart from weir.h,
// which declares the kernels these call, so that each file stays one concept.

#pragma once

#include <cstdint>

#include "weir.h"

namespace weir {

// A weight of the stack: float32 panels (gemm_pack's, format kWF32) or a packed WFormat
// (wpack's); `n` its outputs.
constexpr int kWF32 = 0;
struct StackWeight {
    int format;
    const void* data;
    int64_t n;
};

// A product's weight in parts side by side, each its own format: Q, K and V of a Q4_K_M file
// (V in Q6_K); a gated MLP's gate and up when their formats differ. One part: the whole weight
// (for a gated product, the pair packed together).
struct StackLinear {
    StackWeight part[3];
    int parts;
};

// The product groups of a layer an adapter may modify, in DecoderLayer::lora's order.
enum LoraGroupId : int { kLoraQkv = 0, kLoraO = 1, kLoraGateUp = 2, kLoraDown = 3, kLoraGroups };

struct DecoderLayer {
    const float* input_norm;  // [hidden]
    const float* post_norm;   // [hidden]
    const float* input_norm_bias;  // a layer norm's bias [hidden] (Nemotron's), or null
    const float* post_norm_bias;
    StackLinear qkv;          // [q + 2 kv outputs, hidden]
    const float* qkv_bias;    // or null
    const float* q_norm;      // [head_dim] or null (no Q/K norm); qk_whole: [heads * head_dim]
    bool qk_whole;            // OLMo's Q/K norms over all heads at once (k_norm: kv width)
    const float* k_norm;
    StackLinear o;        // [hidden, heads * head_dim]
    const float* o_bias;  // [hidden] or null
    const float* sinks;   // gpt-oss's: a logit per head in each softmax's sum [heads], or null
    StackLinear gate_up;  // the gated pair [intermediate, hidden] x 2 (or gate, up)
    bool plain_up;        // an ungated MLP (Arcee's): gate_up is up's plain product, act after it
    const float* up_bias;    // an ungated MLP's biases (StarCoder2's): [intermediate], or null
    const float* down_bias;  // [hidden], or null
    float xielu[4];          // an ungated MLP's xIELU constants (Apertus's; weir.h kXielu)
    StackLinear down;     // [hidden, intermediate]
    void* k_cache;        // [blocks, block_size, kv_heads, head_dim], of DecoderModel::cache_dtype
    void* v_cache;
    // The adapters' slots per product group (a null: no adapter modifies that group)
    LoraGroup lora[kLoraGroups];
    // A mixture of experts in place of gate_up and down (experts > 0; moe.cpp): the router
    // [experts, hidden] (and its bias [experts], or null), each expert's gated pair
    // [expert_intermediate, hidden] x 2 and down [hidden, expert_intermediate], top_k of them a
    // token, their weights renormalized over the k when `renormalize`. gpt-oss's experts
    // (swiglu_limit > 0): each gate/up one plain product [2 expert_intermediate, hidden] (gate's
    // rows first), its bias added, then (up + 1) * gate * sigmoid(swiglu_alpha gate) with gate
    // clamped above and up on both sides at swiglu_limit; down's bias added to its outputs
    int64_t experts, top_k, expert_intermediate;
    int renormalize;
    StackWeight router;
    const float* router_bias;
    const WPart* expert_gate_up;  // [experts]
    const WPart* expert_down;     // [experts]
    bool plain_experts;  // gate/up plain products (gpt-oss's), set at binding
    float swiglu_limit, swiglu_alpha;
    const float* expert_gate_up_bias;  // [experts, 2 expert_intermediate] or null
    const float* expert_down_bias;     // [experts, hidden] or null
    // Qwen2-MoE's shared expert beside the mixture (shared_gate.data null: none): gate_up and
    // down above hold its MLP, of shared_intermediate; its output, weighted by the sigmoid of
    // shared_gate's one logit [1, hidden], is added after the routed experts' sum
    StackWeight shared_gate;
    int64_t shared_intermediate;
    // This layer's attention window (0: the whole context), and whether it turns with the
    // model's second rotation (Gemma 3's sliding layers: DecoderStep's local tables)
    int64_t window;
    int local_rope;
    // Gemma 3's norms after the blocks (post_attn_norm null: none): each block's output
    // normalized before its residual add, the MLP's input by pre_ffn_norm instead of post_norm
    const float* post_attn_norm;  // [hidden]
    const float* pre_ffn_norm;
    const float* post_ffn_norm;
    // A checkpoint's FP8 KV cache scales (gpu/kv_scales.py; all 0: none): K and V times k_mul
    // and v_mul before their cache writes, the scores by score_scale in place of the model's
    // scale, the attention's output times out_scale
    float k_mul, v_mul, score_scale, out_scale;
};

// Scratch for moe_block, sized by the step's tokens and the model's largest mixture.
struct MoeScratch {
    float* logits;     // [tokens, experts]
    float* weights;    // [tokens, top_k]
    int32_t* chosen;   // [tokens, top_k]
    int64_t* order;    // [tokens * top_k]: the (token, choice) pairs by expert
    int64_t* counts;   // [experts + 1]
    float* rows;       // [tokens * top_k, hidden]: the pairs' inputs
    float* gated;      // [tokens * top_k, expert_intermediate] (plain experts: twice that)
    float* outs;       // [tokens * top_k, hidden]
};

// x [tokens, hidden] += the mixture's output for h [tokens, hidden]: each token's top_k experts
// by the router's softmax (float32), run as wgemm_experts, their outputs weighted and summed in
// the order of the token's choices (best first), as gpu/models/moe.py computes it; with
// `shared` [tokens, hidden] (Qwen2-MoE's shared expert's outputs) that sum plus each token's
// row of it weighted by the sigmoid of its `shared_logit`, before the sum reaches x.
void moe_block(const DecoderLayer& L, const float* h, int64_t tokens, int64_t hidden, float* x,
               const MoeScratch& s, int act, int64_t num_threads, const float* shared = nullptr,
               const float* shared_logit = nullptr, float weight_scale = 1.f);

struct DecoderModel {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_layers;
    int64_t block_size, sliding_window;
    float eps, scale;
    int64_t act;          // the Gated code of the MLP's activation (kRelu2: ungated MLPs only)
    int64_t cache_dtype;  // the K/V cache's DType
    const DecoderLayer* layers;
    int64_t moe_experts, moe_top_k, moe_intermediate;  // the largest of its layers' (0: none;
                                                       // plain experts: their 2 intermediate)
    int64_t shared_intermediate;                       // so of its shared experts (0: none)
    float embed_scale;  // the embeddings' factor (Gemma's sqrt(hidden), rounded to float32)
    float attn_softcap;  // Gemma 2's cap on the attention scores (0: none)
    float residual_scale;  // Granite's factor on each block's output (1: none)
    // Ministral 3's attention temperature: each rotated query times 1 + q_beta * log(1 +
    // floor(position / q_length)) (q_beta 0: none)
    float q_beta;
    int64_t q_length;
    bool norm_after_rope;  // Hunyuan's: Q and K rotated, then normalized per head
    // Cohere's: every norm (the layers' and the final one) mean-centred (layer_norm), and each
    // layer's attention and MLP side by side on its input norm (post_norm unread: null)
    bool layer_norm, parallel_block;
    float qkv_clip;  // OLMo's: Q, K and V clamped to [-clip, clip] after their product (0: none)
    const float* final_norm;
    const float* final_norm_bias;  // a layer norm's bias, or null
    StackWeight embed;    // [vocab, hidden]: float32 rows (kWF32, not panels) or a packed WFormat
    StackWeight lm_head;  // [vocab, hidden], or data null: no logits here
};

struct DecoderStep {
    int64_t tokens;
    float* x;              // [tokens, hidden] scratch: the embeddings, then the residual stream
    float* out;            // [tokens, hidden], the final norm of x
    const int64_t* slots;  // [tokens], -1: write nothing
    const int32_t* block_tables;
    int64_t max_blocks;
    const int32_t* query_start;
    const int32_t* seq_lens;
    int64_t num_seqs;
    int64_t num_threads;
    // x starts as the rows input_ids of embed [vocab, hidden]; each token's rotary rows are the
    // rows positions of cos_table / sin_table [table_rows, head_dim].
    const int64_t* input_ids;
    const int64_t* positions;
    const float* cos_table;
    const float* sin_table;
    int64_t table_rows;
    // the second rotation's tables [local_rows, head_dim] (layers with local_rope), or null
    const float* cos_local_table;
    const float* sin_local_table;
    int64_t local_rows;
    // logits [num_logits, vocab] of out's rows logits_rows (null: rows 0..num_logits-1);
    // logits null: none
    const int64_t* logits_rows;
    int64_t num_logits;
    float* logits;
    // Each token's adapter slot ([tokens], -1: none), or null: no adapter in the step, and no
    // LoRA work at all.
    const int32_t* lora_rows;
};

// Returns 0; 2 for a token id outside the vocabulary, 3 for a position past the rotary table, 4
// for a logits row outside the step's tokens; else the attention's code.
int decoder_forward(const DecoderModel& m, const DecoderStep& s);

// The op kinds forward_profile times, in its order.
enum ProfileOp { kNorm, kQkv, kRope, kKv, kAttention, kOut, kGateUp, kDown, kLogits, kOps };

// Copies the seconds spent per op kind since the last call into out[kOps] (when given) and
// zeroes them; `enable` switches the timing on or off (benchmarks: a step's breakdown).
void forward_profile(double* out, bool enable);

}  // namespace weir
