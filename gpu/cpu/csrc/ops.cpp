// The torch operators over weir's CPU kernels: torch.ops.weir.* and torch.classes.weir.*.
//
// The only source built with torch's headers. Each operator's schema is its one declaration on
// the Python side (torch checks every call against it: a wrong type or a missing argument is a
// TypeError or RuntimeError there); here every tensor is checked before a raw pointer is taken
// (dtype, device, rank, sizes, strides, and the indexes the kernel will follow: block ids,
// slots, rows), so a wrong argument is an exception, never memory corruption. The kernels run
// with the interpreter lock released (torch's operator call releases it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "weir.h"

namespace {

using at::Tensor;
using c10::optional;

int64_t threads() { return at::get_num_threads(); }

void check_cpu(const Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), name, ": missing");
    TORCH_CHECK(t.device().is_cpu(), name, ": needs a CPU tensor, got ", t.device());
}

void check_f32(const Tensor& t, const char* name) {
    check_cpu(t, name);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, name, ": needs float32, got ",
                      t.scalar_type());
}

// A contiguous tensor of `type` with `numel` elements.
void check_flat(const Tensor& t, at::ScalarType type, int64_t numel, const char* name) {
    check_cpu(t, name);
    TORCH_CHECK_VALUE(t.scalar_type() == type, name, ": needs ", type, ", got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, ": must be contiguous");
    TORCH_CHECK_VALUE(t.numel() == numel, name, ": needs ", numel, " elements, got ", t.numel());
}

// A [rows, cols] float32 matrix whose rows are contiguous (any row stride >= cols).
void check_rows(const Tensor& t, int64_t rows, int64_t cols, const char* name) {
    check_f32(t, name);
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, ": needs [",
                      rows, ", ", cols, "], got ", t.sizes());
    TORCH_CHECK_VALUE(rows == 0 || (t.stride(1) == 1 && t.stride(0) >= cols), name,
                      ": rows must be contiguous");
}

int dtype_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return weir::kFloat32;
        case at::kBFloat16: return weir::kBFloat16;
        case at::kHalf: return weir::kFloat16;
        default: return -1;
    }
}

// ---- the paged cache's step layout: the indexes the attention and K/V writes follow ----
struct Paged {
    int64_t num_blocks, block_size, num_seqs, max_blocks;
};

// k_cache [blocks, block_size, kv_heads, dim]; block_tables [seqs, max_blocks] int32;
// query_start [seqs + 1] int32 (0, ..., tokens, non-decreasing); seq_lens [seqs] int32, each at
// least its query length and within its table; every block id a sequence reaches in range.
Paged check_paged(const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
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

// ---- norm and rotation ----
Tensor rms_norm_rope(const Tensor& x, const optional<Tensor>& weight, double eps,
                     const optional<Tensor>& cos, const optional<Tensor>& sin) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, "x: needs [tokens, dim] or [tokens, heads, "
                      "dim], got ", x.sizes());
    const int64_t tokens = x.size(0), dim = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1;
    TORCH_CHECK_VALUE(tokens == 0 || (x.stride(-1) == 1 &&
                                      (x.dim() == 2 || x.stride(1) == dim) &&
                                      x.stride(0) >= heads * dim),
                      "x: rows must be contiguous");
    TORCH_CHECK_VALUE(weight.has_value() || cos.has_value(), "give a weight, a rotation or both");
    TORCH_CHECK_VALUE(cos.has_value() == sin.has_value(), "cos/sin: give both or neither");
    if (weight) check_flat(*weight, at::kFloat, dim, "weight");
    if (cos) {
        TORCH_CHECK_VALUE(dim % 2 == 0, "cos/sin: the rotation needs an even dim");
        check_flat(*cos, at::kFloat, tokens * dim, "cos/sin");
        check_flat(*sin, at::kFloat, tokens * dim, "cos/sin");
    }
    Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    if (tokens > 0)
        weir::rms_norm_rope(x.data_ptr<float>(), tokens, heads, dim, x.stride(0),
                            weight ? weight->data_ptr<float>() : nullptr, float(eps),
                            cos ? cos->data_ptr<float>() : nullptr,
                            sin ? sin->data_ptr<float>() : nullptr, out.data_ptr<float>(),
                            threads());
    return out;
}

// ---- packed products ----
Tensor gemm_pack(const Tensor& w, const optional<Tensor>& w2) {
    check_f32(w, "w");
    TORCH_CHECK_VALUE(w.dim() == 2 && w.is_contiguous(), "w: needs a contiguous [n, k] tensor");
    if (w2) {
        check_f32(*w2, "w2");
        TORCH_CHECK_VALUE(w2->sizes() == w.sizes() && w2->is_contiguous(),
                          "w2: needs a contiguous tensor the shape of w");
    }
    const int64_t n = w.size(0), k = w.size(1);
    Tensor packed = at::empty({weir::gemm_packed_size(n, k, w2.has_value())}, w.options());
    weir::gemm_pack(w.data_ptr<float>(), w2 ? w2->data_ptr<float>() : nullptr, n, k,
                    w2.has_value(), packed.data_ptr<float>());
    return packed;
}

void check_packed(const Tensor& packed, int64_t n, int64_t k, bool gated) {
    check_flat(packed, at::kFloat, weir::gemm_packed_size(n, k, gated), "packed");
}

Tensor gemm(const Tensor& x, const Tensor& packed, int64_t n, int64_t gated,
            const optional<Tensor>& bias, const optional<Tensor>& residual) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.dim() == 2, "x: needs [rows, k], got ", x.sizes());
    const int64_t m = x.size(0), k = x.size(1);
    check_rows(x, m, k, "x");
    TORCH_CHECK_VALUE(gated >= weir::kPlain && gated <= weir::kGeluTanh, "gated: 0 to 3");
    check_packed(packed, n, k, gated != weir::kPlain);
    TORCH_CHECK_VALUE(!(gated && (bias || residual)), "a gated pair takes no bias or residual");
    if (bias) check_flat(*bias, at::kFloat, n, "bias");
    if (residual) check_rows(*residual, m, n, "residual");
    Tensor out = at::empty({m, n}, x.options());
    if (m > 0)
        weir::gemm(x.data_ptr<float>(), m, k, x.stride(0), packed.data_ptr<float>(), n,
                   int(gated), bias ? bias->data_ptr<float>() : nullptr,
                   residual ? residual->data_ptr<float>() : nullptr,
                   residual ? residual->stride(0) : 0, out.data_ptr<float>(), n, threads());
    return out;
}

// ---- attention ----
Tensor paged_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& query_start,
                       const Tensor& seq_lens, double scale, int64_t sliding_window) {
    check_cpu(query, "query");
    TORCH_CHECK_VALUE(query.dim() == 3 && query.is_contiguous(),
                      "query: needs a contiguous [tokens, heads, dim] tensor");
    const int qt = dtype_code(query.scalar_type()), ct = dtype_code(k_cache.scalar_type());
    TORCH_CHECK_VALUE(qt >= 0 && ct >= 0 && v_cache.scalar_type() == k_cache.scalar_type() &&
                          (ct == qt || qt == weir::kFloat32),
                      "cpu attention: unsupported dtypes ", query.scalar_type(), ", ",
                      k_cache.scalar_type(), ", ", v_cache.scalar_type());
    const Paged p =
        check_paged(k_cache, v_cache, block_tables, query_start, seq_lens, query.size(0));
    const int64_t heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(2);
    TORCH_CHECK_VALUE(k_cache.size(3) == dim, "caches: head dim ", k_cache.size(3), ", query's ",
                      dim);
    TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads over ",
                      kv_heads, " KV heads");
    TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 0");
    Tensor out = at::empty_like(query);
    const int rc = weir::paged_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr<int32_t>(), query_start.data_ptr<int32_t>(),
        seq_lens.data_ptr<int32_t>(), p.num_seqs, p.max_blocks, heads, kv_heads, dim,
        p.block_size, float(scale), sliding_window, threads(), qt, ct);
    TORCH_CHECK(rc == 0, "cpu attention kernel failed (", rc, ")");
    return out;
}

// ---- sampling ----
Tensor argmax(const Tensor& logits) {
    check_f32(logits, "logits");
    TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) > 0, "logits: needs [rows, vocab]");
    check_rows(logits, logits.size(0), logits.size(1), "logits");
    Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
    weir::argmax(logits.data_ptr<float>(), logits.size(0), logits.size(1), logits.stride(0),
                 out.data_ptr<int64_t>(), threads());
    return out;
}

void apply_token_bitmask_(Tensor& logits, const Tensor& rows, const Tensor& mask) {
    check_f32(logits, "logits");
    TORCH_CHECK_VALUE(logits.dim() == 2, "logits: needs [rows, vocab]");
    check_rows(logits, logits.size(0), logits.size(1), "logits");
    check_cpu(rows, "rows");
    TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
                      "rows: needs a contiguous int64 vector");
    const int64_t n = rows.size(0), vocab = logits.size(1);
    check_cpu(mask, "mask");
    TORCH_CHECK_VALUE(mask.scalar_type() == at::kInt && mask.dim() == 2 && mask.size(0) == n &&
                          mask.is_contiguous() && mask.size(1) * 32 >= vocab,
                      "mask: needs a contiguous [rows, words] int32 tensor covering the vocabulary");
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK_INDEX(r[i] >= 0 && r[i] < logits.size(0), "row ", r[i], " outside the logits");
    if (n > 0)
        weir::apply_token_bitmask(logits.data_ptr<float>(), logits.stride(0), r, n,
                                  mask.data_ptr<int32_t>(), mask.size(1), vocab, threads());
}

// ---- the pool and the forward's profile ----
std::tuple<Tensor, Tensor> pool_selftest(int64_t tasks, int64_t threads_, bool hold,
                                         int64_t worker_us) {
    TORCH_CHECK_VALUE(tasks >= 1, "tasks must be >= 1");
    TORCH_CHECK_VALUE(!hold || (tasks >= 2 && threads_ >= 2), "hold needs 2 tasks and threads");
    Tensor runs = at::zeros({tasks}, at::kInt), by = at::zeros({tasks}, at::kInt);
    weir::pool_selftest(tasks, threads_, hold, worker_us, runs.data_ptr<int32_t>(),
                        by.data_ptr<int32_t>());
    return {runs, by};
}

std::vector<double> forward_profile(bool enable) {
    std::vector<double> out(weir::kOps);
    weir::forward_profile(out.data(), enable);
    return out;
}

}  // namespace

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

TORCH_LIBRARY(weir, m) {
    m.def("rms_norm_rope(Tensor x, Tensor? weight, float eps, Tensor? cos, Tensor? sin) -> Tensor",
          &rms_norm_rope);
    m.def("gemm_pack(Tensor w, Tensor? w2) -> Tensor", &gemm_pack);
    m.def("gemm(Tensor x, Tensor packed, int n, int gated, Tensor? bias, Tensor? residual) -> "
          "Tensor",
          &gemm);
    m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor query_start, Tensor seq_lens, float scale, int sliding_window) -> Tensor",
          &paged_attention);
    m.def("argmax(Tensor logits) -> Tensor", &argmax);
    m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor mask) -> ()",
          &apply_token_bitmask_);
    m.def("pool_selftest(int tasks, int threads, bool hold, int worker_us) -> (Tensor, Tensor)",
          &pool_selftest);
    m.def("forward_profile(bool enable) -> float[]", &forward_profile);
    m.class_<DecoderStack>("DecoderStack")
        .def(torch::init<std::vector<std::vector<Tensor>>, std::vector<int64_t>, double, double,
                         Tensor, Tensor, Tensor>())
        .def("run", &DecoderStack::run);
}
