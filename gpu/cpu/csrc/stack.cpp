// torch.classes.weir.DecoderStack: the layer stack in one call (forward.cpp), bound once to a
// model's weights and KV caches and run per step. Its tensors are checked here as ops.cpp
// checks the operators' (checks.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "weir.h"

using namespace weir_ops;

// ---- the layer stack in one call ----
// Built once per model and KV cache: holds every weight and cache tensor it points into (so they
// live as long as it does), checked once here; each step passes only the step's own tensors.
struct DecoderStack : torch::CustomClassHolder {
    std::vector<Tensor> keep;  // every tensor a pointer below points into
    std::vector<weir::DecoderLayer> layers;
    weir::DecoderModel model{};
    Tensor embed, k_cache;  // k_cache: the first layer's, whose shape every layer's shares

    // layers: per layer [input_norm, post_norm, qkv, qkv_bias, q_norm, k_norm, o, gate_up, down,
    // k_cache, v_cache] (empty tensors for an absent bias or Q/K norm); dims: [hidden, heads,
    // kv_heads, head_dim, intermediate, sliding_window, act, vocab]; lm_head: packed [vocab,
    // hidden], or empty (vocab 0).
    DecoderStack(std::vector<std::vector<Tensor>> per_layer, std::vector<int64_t> dims,
                 double eps, double scale, Tensor embed_, Tensor final_norm, Tensor lm_head) {
        TORCH_CHECK_VALUE(dims.size() == 8, "dims: [hidden, heads, kv_heads, head_dim, "
                          "intermediate, sliding_window, act, vocab]");
        TORCH_CHECK_VALUE(!per_layer.empty(), "no layers");
        const int64_t H = dims[0], heads = dims[1], kv = dims[2], D = dims[3], I = dims[4];
        TORCH_CHECK_VALUE(H > 0 && heads > 0 && kv > 0 && D > 0 && I > 0 && heads % kv == 0 &&
                              D % 2 == 0,
                          "dims: bad shape ", c10::IntArrayRef(dims));
        TORCH_CHECK_VALUE(dims[6] >= weir::kSilu && dims[6] <= weir::kGeluTanh, "act: 1 to 3");
        const int64_t qw = heads * D, kvw = kv * D;
        auto keep_ = [&](const Tensor& t) -> const float* {
            keep.push_back(t);
            return t.numel() ? t.data_ptr<float>() : nullptr;
        };
        const Tensor& k0 = per_layer[0].at(9);
        check_cpu(k0, "k_cache");
        k_cache = k0;
        check_f32(embed_, "embed");
        TORCH_CHECK_VALUE(embed_.dim() == 2 && embed_.size(1) == H && embed_.is_contiguous(),
                          "embed: needs a contiguous [vocab, hidden] tensor");
        embed = embed_;
        keep.push_back(embed_);
        for (const auto& L : per_layer) {
            TORCH_CHECK_VALUE(L.size() == 11, "each layer gives 11 tensors");
            check_flat(L[0], at::kFloat, H, "input_norm");
            check_flat(L[1], at::kFloat, H, "post_norm");
            check_packed(L[2], qw + 2 * kvw, H, false);
            if (L[3].numel()) check_flat(L[3], at::kFloat, qw + 2 * kvw, "qkv_bias");
            TORCH_CHECK_VALUE(bool(L[4].numel()) == bool(L[5].numel()), "q_norm/k_norm: both");
            if (L[4].numel()) {
                check_flat(L[4], at::kFloat, D, "q_norm");
                check_flat(L[5], at::kFloat, D, "k_norm");
            }
            check_packed(L[6], H, qw, false);
            check_packed(L[7], I, H, true);
            check_packed(L[8], H, I, false);
            const Tensor &kc = L[9], &vc = L[10];
            check_cpu(kc, "k_cache");
            TORCH_CHECK_VALUE(kc.dim() == 4 && kc.sizes() == k0.sizes() &&
                                  vc.sizes() == k0.sizes() && kc.size(2) == kv &&
                                  kc.size(3) == D && kc.is_contiguous() && vc.is_contiguous() &&
                                  kc.scalar_type() == k0.scalar_type() &&
                                  vc.scalar_type() == k0.scalar_type() &&
                                  dtype_code(kc.scalar_type()) >= 0,
                              "caches: every layer's two contiguous [blocks, block_size, ",
                              kv, ", ", D, "] tensors of one float type");
            weir::DecoderLayer d{};
            d.input_norm = keep_(L[0]);
            d.post_norm = keep_(L[1]);
            d.qkv = keep_(L[2]);
            d.qkv_bias = keep_(L[3]);
            d.q_norm = keep_(L[4]);
            d.k_norm = keep_(L[5]);
            d.o = keep_(L[6]);
            d.gate_up = keep_(L[7]);
            d.down = keep_(L[8]);
            keep.push_back(kc);
            keep.push_back(vc);
            d.k_cache = kc.data_ptr();
            d.v_cache = vc.data_ptr();
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
        model.cache_dtype = dtype_code(k0.scalar_type());
        model.layers = layers.data();
        model.final_norm = keep_(final_norm);
        if (lm_head.numel()) {
            TORCH_CHECK_VALUE(dims[7] > 0, "lm_head: give its vocab");
            check_packed(lm_head, dims[7], H, false);
            model.lm_head = keep_(lm_head);
            model.vocab = dims[7];
        }
    }

    // The final norm [tokens, hidden] of the stack over the embeddings of input_ids at
    // `positions` (rotary rows of cos / sin [rows, head_dim]), K/V written at `slots`; with
    // logits_rows (when the model has the head here), also the logits of those rows, else an
    // empty tensor.
    std::tuple<Tensor, Tensor> run(const Tensor& input_ids, const Tensor& positions,
                                   const Tensor& cos, const Tensor& sin, const Tensor& slots,
                                   const Tensor& block_tables, const Tensor& query_start,
                                   const Tensor& seq_lens, const optional<Tensor>& logits_rows) {
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
        s.embed = embed.data_ptr<float>();
        s.vocab = embed.size(0);
        s.positions = positions.data_ptr<int64_t>();
        s.cos_table = cos.data_ptr<float>();
        s.sin_table = sin.data_ptr<float>();
        s.table_rows = cos.size(0);
        Tensor logits = at::empty({0}, cos.options());
        if (logits_rows) {
            TORCH_CHECK_VALUE(model.lm_head != nullptr && model.vocab > 0,
                              "this model's LM head is not on the compiled path");
            const int64_t n = logits_rows->numel();
            check_flat(*logits_rows, at::kLong, n, "logits_rows");
            logits = at::empty({n, model.vocab}, cos.options());
            s.num_logits = n;
            s.logits = logits.data_ptr<float>();
            if (n != T) s.logits_rows = logits_rows->data_ptr<int64_t>();
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
        .def(torch::init<std::vector<std::vector<Tensor>>, std::vector<int64_t>, double, double,
                         Tensor, Tensor, Tensor>())
        .def("run", &DecoderStack::run);
}
