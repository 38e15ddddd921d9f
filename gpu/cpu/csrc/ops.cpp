// The torch operators over weir's CPU kernels: torch.ops.weir.* (the layer stack's class,
// torch.classes.weir.DecoderStack, is stack.cpp's).
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
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "huge_pages.h"
#include "decoder.h"

namespace {

using namespace weir_ops;

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

Tensor layer_norm(const Tensor& x, const Tensor& weight, double eps, const optional<Tensor>& bias) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(-1) == 1 && x.stride(0) >= x.size(1),
                      "x: needs [tokens, dim] with contiguous rows, got ", x.sizes());
    check_flat(weight, at::kFloat, x.size(1), "weight");
    if (bias) check_flat(*bias, at::kFloat, x.size(1), "bias");
    Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    if (x.numel() > 0)
        weir::layer_norm(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0),
                         weight.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                         float(eps), out.data_ptr<float>(), threads());
    return out;
}

// An ungated MLP's activation in place (weir.h activate_rows; xIELU's four constants in params)
void activate_(Tensor& x, int64_t act, std::vector<double> params) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.is_contiguous(), "x: needs a contiguous tensor");
    TORCH_CHECK_VALUE(act >= weir::kSilu && act <= weir::kXielu, "act: 1 to 5");
    TORCH_CHECK_VALUE(act != weir::kXielu || params.size() == 4, "xielu: four constants");
    float p[4] = {};
    for (size_t i = 0; i < params.size() && i < 4; ++i) p[i] = float(params[i]);
    weir::activate_rows(x.data_ptr<float>(), x.numel(), int(act), p, threads());
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
    Tensor packed = huge_empty({weir::gemm_packed_size(n, k, w2.has_value())}, at::kFloat);
    weir::gemm_pack(w.data_ptr<float>(), w2 ? w2->data_ptr<float>() : nullptr, n, k,
                    w2.has_value(), packed.data_ptr<float>());
    return packed;
}

Tensor gemm(const Tensor& x, const Tensor& packed, int64_t n, int64_t gated,
            const optional<Tensor>& bias, const optional<Tensor>& residual) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.dim() == 2, "x: needs [rows, k], got ", x.sizes());
    const int64_t m = x.size(0), k = x.size(1);
    check_rows(x, m, k, "x");
    TORCH_CHECK_VALUE(gated >= weir::kPlain && gated <= weir::kGeluTanh, "gated: 0 to 3");
    check_packed(packed, n, k, gated != weir::kPlain);
    TORCH_CHECK_VALUE(!(gated && bias), "a gated pair takes no bias");
    if (bias) check_flat(*bias, at::kFloat, n, "bias");
    if (residual) check_rows(*residual, m, gated ? 2 * n : n, "residual");
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
                       const Tensor& seq_lens, double scale, int64_t sliding_window,
                       double softcap, const std::optional<Tensor>& sinks) {
    check_cpu(query, "query");
    TORCH_CHECK_VALUE(query.dim() == 3 && query.is_contiguous(),
                      "query: needs a contiguous [tokens, heads, dim] tensor");
    const int qt = dtype_code(query.scalar_type()), ct = cache_code(k_cache.scalar_type());
    TORCH_CHECK_VALUE(qt >= 0 && ct >= 0 && v_cache.scalar_type() == k_cache.scalar_type() &&
                          (ct == qt || qt == weir::kFloat32 || ct >= weir::kFp8E5M2),
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
    TORCH_CHECK_VALUE(softcap >= 0, "softcap must be >= 0");
    if (sinks) {
        check_f32(*sinks, "sinks");
        TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == heads && sinks->is_contiguous(),
                          "sinks: needs a contiguous [", heads, "] tensor");
    }
    Tensor out = at::empty_like(query);
    const int rc = weir::paged_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr<int32_t>(), query_start.data_ptr<int32_t>(),
        seq_lens.data_ptr<int32_t>(), p.num_seqs, p.max_blocks, heads, kv_heads, dim,
        p.block_size, float(scale), sliding_window, threads(), qt, ct, float(softcap),
        sinks ? sinks->data_ptr<float>() : nullptr);
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

// ---- LoRA ----
void lora_add_(Tensor& y, const Tensor& x, const Tensor& a, const Tensor& b, const Tensor& ranks,
               const Tensor& cols, const Tensor& rows) {
    const weir::LoraGroup g = check_lora_group(a, b, ranks, cols);
    TORCH_CHECK_VALUE(x.dim() == 2 && y.dim() == 2, "x, y: need [rows, k] and [rows, n]");
    const int64_t m = x.size(0);
    check_rows(x, m, g.k, "x");
    check_rows(y, m, g.n, "y");
    const int32_t* slot = check_lora_rows(rows, m, g.slots);
    if (m > 0)
        weir::lora_add(g, x.data_ptr<float>(), m, x.stride(0), slot, y.data_ptr<float>(),
                       y.stride(0), threads());
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

// x rounded to a K/V cache's dtype as the compiled forward writes it (tests: torch's .to()).
Tensor round_to_cache(const Tensor& x, c10::ScalarType dtype) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.is_contiguous(), "x: must be contiguous");
    TORCH_CHECK_VALUE(cache_code(dtype) >= 0, "round_to_cache: ", dtype, " is no cache dtype");
    Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
    weir::round_to_cache(x.data_ptr<float>(), x.numel(), cache_code(dtype), out.data_ptr());
    return out;
}

// The paged KV cache's tensors (gpu/kv_cache.py): zeroed now, so that its pages are faulted in
// at load (as huge pages where the system gives them) and not by the first steps that reach them.
Tensor huge_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
    for (const int64_t s : sizes) TORCH_CHECK_VALUE(s >= 0, "size: ", sizes, " has a negative dimension");
    return huge_empty(sizes, dtype).zero_();
}

}  // namespace

TORCH_LIBRARY(weir, m) {
    m.def("rms_norm_rope(Tensor x, Tensor? weight, float eps, Tensor? cos, Tensor? sin) -> Tensor",
          &rms_norm_rope);
    m.def("layer_norm(Tensor x, Tensor weight, float eps, Tensor? bias=None) -> Tensor",
          &layer_norm);
    m.def("activate_(Tensor(a!) x, int act, float[] params=[]) -> ()", &activate_);
    m.def("gemm_pack(Tensor w, Tensor? w2) -> Tensor", &gemm_pack);
    m.def("gemm(Tensor x, Tensor packed, int n, int gated, Tensor? bias, Tensor? residual) -> "
          "Tensor",
          &gemm);
    m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor query_start, Tensor seq_lens, float scale, int sliding_window, "
          "float softcap=0.0, Tensor? sinks=None) -> Tensor",
          &paged_attention);
    m.def("argmax(Tensor logits) -> Tensor", &argmax);
    m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor mask) -> ()",
          &apply_token_bitmask_);
    m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor ranks, Tensor cols, "
          "Tensor rows) -> ()",
          &lora_add_);
    m.def("pool_selftest(int tasks, int threads, bool hold, int worker_us) -> (Tensor, Tensor)",
          &pool_selftest);
    m.def("forward_profile(bool enable) -> float[]", &forward_profile);
    m.def("huge_zeros(int[] size, ScalarType dtype) -> Tensor", &huge_zeros);
    m.def("round_to_cache(Tensor x, ScalarType dtype) -> Tensor", &round_to_cache);
}
