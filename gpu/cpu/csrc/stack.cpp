// torch.classes.weir.DecoderStack: the layer stack in one call (forward.cpp), bound once to a
// model's weights and KV caches and run per step. Its tensors are checked here as ops.cpp
// checks the operators' (checks.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "checks.h"
#include "stack_bias.h"
#include "stack_gemma.h"
#include "stack_gpt_oss.h"
#include "stack_lora.h"
#include "stack_kv_scales.h"
#include "stack_shared.h"
#include "decoder.h"

using namespace weir_ops;

// Built once per model and KV cache: holds every weight and cache tensor it points into (so they
// live as long as it does), checked once here; each step passes only the step's own tensors.
struct DecoderStack : torch::CustomClassHolder {
    std::vector<Tensor> keep;  // every tensor a pointer below points into
    std::vector<weir::DecoderLayer> layers;
    weir::DecoderModel model{};
    Tensor k_cache;  // the first layer's, whose shape every layer's shares

    // layers: per layer [input_norm, post_norm, qkv0, qkv1, qkv2, qkv_bias, q_norm, k_norm, o,
    // gate_up0, gate_up1, down, k_cache, v_cache] (empty tensors for absent parts, bias, Q/K
    // norm or Cohere's post_norm); formats: per layer [qkv format and outputs x 3 (0 outputs: no part), o, gate_up0,
    // gate_up1 (-1: none, gate_up0 is the packed pair; -2: gate_up0 is an ungated MLP's up),
    // down]. A mixture of experts' layer
    // (gate_up0/1 and down empty) adds [router, E gated pairs, E downs] to its tensors and
    // [router format, E, top_k, flags (1: renormalize, 2: each gate/up a plain product, as
    // gpt-oss's), expert intermediate, E pair formats, E down formats] to its formats. dims: [hidden, heads, kv_heads,
    // head_dim, intermediate, sliding_window, act, vocab, embed format, head format (-1: no
    // head here)]; embed: [vocab, hidden]; lm_head: [vocab, hidden] or empty.
    DecoderStack(std::vector<std::vector<Tensor>> per_layer,
                 std::vector<std::vector<int64_t>> formats, std::vector<int64_t> dims, double eps,
                 double scale, Tensor embed, Tensor final_norm, Tensor lm_head) {
        TORCH_CHECK_VALUE(dims.size() == 10, "dims: [hidden, heads, kv_heads, head_dim, "
                          "intermediate, sliding_window, act, vocab, embed format, head format]");
        TORCH_CHECK_VALUE(!per_layer.empty() && formats.size() == per_layer.size(),
                          "layers and formats: one entry per layer");
        const int64_t H = dims[0], heads = dims[1], kv = dims[2], D = dims[3], I = dims[4];
        const int64_t vocab = dims[7];
        TORCH_CHECK_VALUE(H > 0 && heads > 0 && kv > 0 && D > 0 && I > 0 && heads % kv == 0 &&
                              D % 2 == 0 && vocab > 0,
                          "dims: bad shape ", c10::IntArrayRef(dims));
        TORCH_CHECK_VALUE(dims[6] >= weir::kSilu && dims[6] <= weir::kXielu, "act: 1 to 5");
        const int64_t qw = heads * D, kvw = kv * D;
        auto keep_ = [&](const Tensor& t) -> const float* {
            keep.push_back(t);
            return t.numel() ? t.data_ptr<float>() : nullptr;
        };
        expert_parts.resize(per_layer.size());  // never resized again: layers point into it
        const Tensor& k0 = per_layer[0].at(12);
        check_cpu(k0, "k_cache");
        k_cache = k0;
        for (size_t li = 0; li < per_layer.size(); ++li) {
            const auto& L = per_layer[li];
            const auto& F = formats[li];
            const int64_t E = F.size() > 10 ? F.at(11) : 0;
            TORCH_CHECK_VALUE(E >= 0 && L.size() == size_t(E ? 15 + 2 * E : 14),
                              "each layer gives 14 tensors (a mixture: 15 + 2 experts)");
            TORCH_CHECK_VALUE(F.size() == size_t(E ? 15 + 2 * E : 10),
                              "each layer gives 10 format entries (a mixture: 15 + 2 experts)");
            if (L[0].numel()) check_flat(L[0], at::kFloat, H, "input_norm");  // OLMo 2: none
            if (L[1].numel()) check_flat(L[1], at::kFloat, H, "post_norm");
            unnormed_mlp |= !L[1].numel();  // (Cohere's: its MLP reads the input norm)
            weir::DecoderLayer d{};
            int64_t qkv_n = 0;
            for (int i = 0; i < 3 && F[2 * i + 1] > 0; ++i) {
                d.qkv.part[d.qkv.parts++] = stack_weight(F[2 * i], L[2 + i], F[2 * i + 1], H, false, "qkv");
                qkv_n += F[2 * i + 1];
                keep.push_back(L[2 + i]);
            }
            TORCH_CHECK_VALUE(qkv_n == qw + 2 * kvw, "qkv: parts of ", qkv_n, " outputs, not ",
                              qw + 2 * kvw);
            if (L[5].numel()) check_flat(L[5], at::kFloat, qw + 2 * kvw, "qkv_bias");
            TORCH_CHECK_VALUE(bool(L[6].numel()) == bool(L[7].numel()), "q_norm/k_norm: both");
            if (L[6].numel()) {  // each head's, or OLMo's over all heads at once
                d.qk_whole = L[6].numel() == qw && qw != D;
                check_flat(L[6], at::kFloat, d.qk_whole ? qw : D, "q_norm");
                check_flat(L[7], at::kFloat, d.qk_whole ? kvw : D, "k_norm");
            }
            d.o.part[0] = stack_weight(F[6], L[8], H, qw, false, "o");
            d.o.parts = 1;
            if (E) {
                TORCH_CHECK_VALUE(dims[6] < weir::kRelu2, "act 4, 5: ungated MLPs only");
                bind_experts(d, L, F, H, li);
            } else if (F[8] == -2) {  // an ungated MLP: up's plain product in gate_up0
                d.gate_up.part[0] = stack_weight(F[7], L[9], I, H, false, "up");
                d.gate_up.parts = 1;
                d.plain_up = true;
            } else {
                TORCH_CHECK_VALUE(dims[6] < weir::kRelu2, "act 4, 5: ungated MLPs only");
                d.gate_up = gated_pair(F[7], L[9], F[8], L[10], I, H, "gate_up");
                if (F[8] >= 0) keep.push_back(L[10]);
            }
            if (!E) {
                d.down.part[0] = stack_weight(F[9], L[11], H, I, false, "down");
                d.down.parts = 1;
            }
            const Tensor &kc = L[12], &vc = L[13];
            check_cpu(kc, "k_cache");
            TORCH_CHECK_VALUE(kc.dim() == 4 && kc.sizes() == k0.sizes() &&
                                  vc.sizes() == k0.sizes() && kc.size(2) == kv &&
                                  kc.size(3) == D && kc.is_contiguous() && vc.is_contiguous() &&
                                  kc.scalar_type() == k0.scalar_type() &&
                                  vc.scalar_type() == k0.scalar_type() &&
                                  cache_code(kc.scalar_type()) >= 0,
                              "caches: every layer's two contiguous [blocks, block_size, ",
                              kv, ", ", D, "] tensors of one cache dtype");
            d.input_norm = keep_(L[0]);
            d.post_norm = keep_(L[1]);
            d.qkv_bias = keep_(L[5]);
            d.q_norm = keep_(L[6]);
            d.k_norm = keep_(L[7]);
            keep.push_back(L[8]);
            if (!E) {
                keep.push_back(L[9]);
                keep.push_back(L[11]);
            }
            keep.push_back(kc);
            keep.push_back(vc);
            d.k_cache = kc.data_ptr();
            d.v_cache = vc.data_ptr();
            d.window = dims[5];
            layers.push_back(d);
        }
        check_flat(final_norm, at::kFloat, H, "final_norm");
        model.hidden = H;
        model.heads = heads;
        model.kv_heads = kv;
        model.head_dim = D;
        model.intermediate = I;
        model.num_layers = int64_t(layers.size());
        model.block_size = k0.size(1);
        model.sliding_window = dims[5];
        model.eps = float(eps);
        model.scale = float(scale);
        model.act = dims[6];
        model.cache_dtype = cache_code(k0.scalar_type());
        model.layers = layers.data();
        for (const auto& d : layers) {
            model.moe_experts = std::max(model.moe_experts, d.experts);
            model.moe_top_k = std::max(model.moe_top_k, d.top_k);
            model.moe_intermediate = std::max(model.moe_intermediate,
                                              d.expert_intermediate * (d.plain_experts ? 2 : 1));
        }
        model.final_norm = keep_(final_norm);
        model.embed_scale = 1.f;
        model.residual_scale = 1.f;
        model.q_beta = 0.f;
        model.q_length = 0;
        model.norm_after_rope = false;
        model.layer_norm = false;
        model.parallel_block = false;
        model.embed = stack_weight(dims[8], embed, vocab, H, false, "embed", true);
        keep.push_back(embed);
        if (dims[9] >= 0) {
            model.lm_head = stack_weight(dims[9], lm_head, vocab, H, false, "lm_head");
            keep.push_back(lm_head);
        }
    }

    // Each mixture layer's experts, as wgemm_experts takes them (DecoderLayer points into it).
    std::vector<std::vector<weir::WPart>> expert_parts;

    // A mixture of experts' layer: the router, each expert's gated pair and down (formats
    // F[15..15+E) and F[15+E..15+2E), tensors from L[15]), checked for its shapes.
    void bind_experts(weir::DecoderLayer& d, const std::vector<Tensor>& L,
                      const std::vector<int64_t>& F, int64_t H, size_t li) {
        const int64_t E = F[11], K = F[12], I = F[14];
        TORCH_CHECK_VALUE(K >= 1 && K <= E && I > 0 && F[13] >= 0 && F[13] <= 3,
                          "experts: top_k ", K, " of ", E, ", intermediate ", I, ", flags ", F[13]);
        d.experts = E;
        d.top_k = K;
        d.renormalize = int(F[13] & 1);
        d.plain_experts = F[13] & 2;  // gate/up plain products: set_gpt_oss gives their activation
        unbound_plain |= d.plain_experts;
        d.expert_intermediate = I;
        d.router = stack_weight(F[10], L[14], E, H, false, "router");
        keep.push_back(L[14]);
        auto& parts = expert_parts.at(li);
        parts.clear();
        for (int64_t e = 0; e < 2 * E; ++e) {
            const bool pair = e < E, plain = d.plain_experts;
            TORCH_CHECK_VALUE(F[15 + e] != weir::kWF32, "experts: packed block formats only");
            const weir::StackWeight w = stack_weight(F[15 + e], L[15 + e],
                                                     pair ? (plain ? 2 * I : I) : H, pair ? H : I,
                                                     pair && !plain, "expert");
            parts.push_back({w.format, static_cast<const uint8_t*>(w.data), w.n});
            keep.push_back(L[15 + e]);
        }
        d.expert_gate_up = parts.data();
        d.expert_down = parts.data() + E;
    }

    // Qwen2-MoE's shared experts (gpu/models/moe.py), bound once: per layer [gate_up0,
    // gate_up1, down, gate] (none: a layer without one, which must then be a mixture's) and its
    // formats [gate_up0, gate_up1 (-1: gate_up0 is the packed pair), down, gate, intermediate];
    // the expert's MLP takes the mixture layer's unused gate_up and down.
    void set_shared(std::vector<std::vector<Tensor>> per_layer,
                    std::vector<std::vector<int64_t>> formats) {
        TORCH_CHECK_VALUE(per_layer.size() == layers.size() && formats.size() == layers.size(),
                          "shared: one entry per layer");
        for (size_t li = 0; li < layers.size(); ++li) {
            if (per_layer[li].empty()) continue;
            bind_shared(layers[li], per_layer[li], formats[li], model.hidden, keep);
            model.shared_intermediate =
                std::max(model.shared_intermediate, layers[li].shared_intermediate);
        }
    }

    // A checkpoint's FP8 KV cache scales (stack_kv_scales.h), bound once: per layer four values
    // or none.
    void set_kv_scales(std::vector<std::vector<double>> per_layer) {
        TORCH_CHECK_VALUE(per_layer.size() == layers.size(), "kv scales: one entry per layer");
        for (size_t li = 0; li < layers.size(); ++li) bind_kv_scales(layers[li], per_layer[li]);
    }

    // gpt-oss's parts (stack_gpt_oss.h; an O bias also a Llama's), bound once, after set_gemma.
    bool unbound_plain = false;  // plain experts whose activation set_gpt_oss has not given
    void set_gpt_oss(std::vector<std::vector<Tensor>> per_layer, double limit, double alpha) {
        TORCH_CHECK_VALUE(per_layer.size() == layers.size(), "gpt_oss: one entry per layer");
        TORCH_CHECK_VALUE(limit > 0 && alpha > 0, "gpt_oss: limit and alpha must be > 0");
        for (size_t li = 0; li < layers.size(); ++li)
            bind_gpt_oss(layers[li], per_layer[li], model, float(limit), float(alpha), keep);
        unbound_plain = false;
    }

    // Gemma 2's and 3's layers (gpu/models/gemma.py), bound once: per layer
    // [post_attention_norm, pre_feedforward_norm, post_feedforward_norm] (all empty: a plain
    // layer), its window (0: none) and whether it turns with the second rotation; the
    // embeddings' factor (float32); Gemma 2's cap on the attention scores (0: none).
    void set_gemma(std::vector<std::vector<Tensor>> norms, std::vector<int64_t> windows,
                   std::vector<int64_t> local, double embed_scale, double attn_softcap) {
        TORCH_CHECK_VALUE(attn_softcap >= 0, "gemma: attn_softcap must be >= 0");
        TORCH_CHECK_VALUE(norms.size() == layers.size() && windows.size() == layers.size() &&
                              local.size() == layers.size(),
                          "gemma: one entry per layer");
        for (size_t li = 0; li < layers.size(); ++li)
            bind_gemma(layers[li], norms[li], windows[li], local[li], model.hidden, keep);
        model.embed_scale = float(embed_scale);
        model.attn_softcap = float(attn_softcap);
    }

    // A layer norm's biases (Nemotron's, StarCoder2's) and an ungated MLP's (StarCoder2's), bound
    // once (stack_bias.h).
    void set_norm_bias(std::vector<std::vector<Tensor>> per_layer, Tensor final_bias) {
        bind_norm_bias(layers, per_layer, final_bias, model, keep);
    }
    void set_mlp_bias(std::vector<std::vector<Tensor>> per_layer) {
        bind_mlp_bias(layers, per_layer, model, keep);
    }
    // xIELU's constants (Apertus's), per layer four (weir.h kXielu).
    void set_xielu(std::vector<std::vector<double>> per_layer) {
        TORCH_CHECK_VALUE(per_layer.size() == layers.size(), "xielu: one entry per layer");
        for (size_t li = 0; li < layers.size(); ++li) {
            TORCH_CHECK_VALUE(per_layer[li].size() == 4 && layers[li].plain_up,
                              "xielu: four constants, an ungated MLP's");
            for (int i = 0; i < 4; ++i) layers[li].xielu[i] = float(per_layer[li][i]);
        }
    }

    // Granite's factor on each block's output (taken on the O and down products' inputs),
    // Ministral 3's attention temperature (its beta, 0: none, and length), Hunyuan's Q/K norms
    // after the rotation, Cohere's layer norms and side-by-side blocks (no post_norm then)
    bool unnormed_mlp = false;  // a layer bound without post_norm: set_extras' parallel first
    void set_extras(double residual, double q_beta, int64_t q_length, bool norm_after_rope,
                    bool layer_norm, bool parallel_block, double qkv_clip) {
        TORCH_CHECK_VALUE(qkv_clip >= 0, "extras: qkv_clip must be >= 0");
        model.qkv_clip = float(qkv_clip);
        TORCH_CHECK_VALUE(std::isfinite(residual) && std::isfinite(q_beta), "extras: finite");
        TORCH_CHECK_VALUE(q_beta == 0 || q_length > 0, "extras: q_length must be > 0");
        model.residual_scale = float(residual);
        model.q_beta = float(q_beta);
        model.q_length = q_length;
        model.norm_after_rope = norm_after_rope;
        model.layer_norm = layer_norm;
        model.parallel_block = parallel_block;
    }

    // The adapters' slots (gpu/lora.py), bound once: per layer, for each product group in
    // weir.h's LoraGroupId order, [a, b, ranks, cols] (an empty a: no adapter modifies it).
    std::vector<std::vector<Tensor>> lora_tensors;
    int64_t lora_slots = 0;

    void set_lora(std::vector<std::vector<Tensor>> per_layer) {
        const int64_t slots = bind_lora(layers, per_layer, model);
        lora_tensors = std::move(per_layer);
        lora_slots = slots;
    }

    // The final norm [tokens, hidden] of the stack over the embeddings of input_ids at
    // `positions` (rotary rows of cos / sin [rows, head_dim]), K/V written at `slots`; with
    // logits_rows (when the model has the head here), also the logits of those rows, else an
    // empty tensor.
    std::tuple<Tensor, Tensor> run(const Tensor& input_ids, const Tensor& positions,
                                   const Tensor& cos, const Tensor& sin, const Tensor& slots,
                                   const Tensor& block_tables, const Tensor& query_start,
                                   const Tensor& seq_lens, const optional<Tensor>& logits_rows,
                                   const optional<Tensor>& lora_rows,
                                   const optional<Tensor>& cos_local,
                                   const optional<Tensor>& sin_local) {
        TORCH_CHECK_VALUE(!unbound_plain, "experts of plain products: set_gpt_oss first");
        TORCH_CHECK_VALUE(!unnormed_mlp || model.parallel_block,
                          "a layer without post_norm: set_extras' parallel_block first");
        const int64_t T = input_ids.numel(), D = model.head_dim;
        check_flat(input_ids, at::kLong, T, "input_ids");
        check_flat(positions, at::kLong, T, "positions");
        check_flat(slots, at::kLong, T, "slots");
        TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(1) == D, "cos/sin: needs [rows, head_dim]");
        check_flat(cos, at::kFloat, cos.numel(), "cos");
        check_flat(sin, at::kFloat, cos.numel(), "sin");
        const Paged p = check_paged(k_cache, k_cache, block_tables, query_start, seq_lens, T);
        const int64_t* sl = slots.data_ptr<int64_t>();
        for (int64_t t = 0; t < T; ++t)
            TORCH_CHECK_INDEX(sl[t] >= -1 && sl[t] < p.num_blocks * p.block_size, "slot ",
                              sl[t], " outside the cache");
        Tensor x = at::empty({T, model.hidden}, cos.options());
        Tensor out = at::empty({T, model.hidden}, cos.options());
        weir::DecoderStep s{};
        s.tokens = T;
        s.x = x.data_ptr<float>();
        s.out = out.data_ptr<float>();
        s.slots = sl;
        s.block_tables = block_tables.data_ptr<int32_t>();
        s.max_blocks = p.max_blocks;
        s.query_start = query_start.data_ptr<int32_t>();
        s.seq_lens = seq_lens.data_ptr<int32_t>();
        s.num_seqs = p.num_seqs;
        s.num_threads = threads();
        s.input_ids = input_ids.data_ptr<int64_t>();
        s.positions = positions.data_ptr<int64_t>();
        s.cos_table = cos.data_ptr<float>();
        s.sin_table = sin.data_ptr<float>();
        s.table_rows = cos.size(0);
        if (cos_local) {  // the second rotation (layers that turn with it)
            TORCH_CHECK_VALUE(sin_local && cos_local->dim() == 2 && cos_local->size(1) == D,
                              "cos_local/sin_local: needs both, [rows, head_dim]");
            check_flat(*cos_local, at::kFloat, cos_local->numel(), "cos_local");
            check_flat(*sin_local, at::kFloat, cos_local->numel(), "sin_local");
            s.cos_local_table = cos_local->data_ptr<float>();
            s.sin_local_table = sin_local->data_ptr<float>();
            s.local_rows = cos_local->size(0);
        }
        Tensor logits = at::empty({0}, cos.options());
        if (logits_rows) {
            TORCH_CHECK_VALUE(model.lm_head.data != nullptr,
                              "this model's LM head is not on the compiled path");
            const int64_t n = logits_rows->numel();
            check_flat(*logits_rows, at::kLong, n, "logits_rows");
            logits = at::empty({n, model.lm_head.n}, cos.options());
            s.num_logits = n;
            s.logits = logits.data_ptr<float>();
            if (n != T) s.logits_rows = logits_rows->data_ptr<int64_t>();
        }
        if (lora_rows) {  // each token's adapter slot; the slots' ranks checked again
            TORCH_CHECK_VALUE(lora_slots > 0, "lora rows given, but no adapter slots bound");
            s.lora_rows = check_lora_rows(*lora_rows, T, lora_slots);
            for (const auto& L : lora_tensors)
                for (int gi = 0; gi < weir::kLoraGroups; ++gi)
                    if (L[4 * gi].numel())
                        check_lora_group(L[4 * gi], L[4 * gi + 1], L[4 * gi + 2], L[4 * gi + 3]);
        }
        const int rc = T ? weir::decoder_forward(model, s) : 0;
        TORCH_CHECK_INDEX(rc != 2, "token id outside the vocabulary");
        TORCH_CHECK_INDEX(rc != 3, "a position past the rotary table");
        TORCH_CHECK_INDEX(rc != 4, "a logits row outside the step's tokens");
        TORCH_CHECK(rc == 0, "cpu forward failed (", rc, ")");
        return {out, logits};
    }
};

TORCH_LIBRARY_FRAGMENT(weir, m) {
    m.class_<DecoderStack>("DecoderStack")
        .def(torch::init<std::vector<std::vector<Tensor>>, std::vector<std::vector<int64_t>>,
                         std::vector<int64_t>, double, double, Tensor, Tensor, Tensor>())
        .def("run", &DecoderStack::run)
        .def("set_lora", &DecoderStack::set_lora)
        .def("set_gemma", &DecoderStack::set_gemma)
        .def("set_extras", &DecoderStack::set_extras)
        .def("set_norm_bias", &DecoderStack::set_norm_bias)
        .def("set_mlp_bias", &DecoderStack::set_mlp_bias)
        .def("set_xielu", &DecoderStack::set_xielu)
        .def("set_shared", &DecoderStack::set_shared)
        .def("set_gpt_oss", &DecoderStack::set_gpt_oss)
        .def("set_kv_scales", &DecoderStack::set_kv_scales);
}
