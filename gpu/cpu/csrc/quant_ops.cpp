// The torch operators over the block- and 16-bit-format kernels (quant.cpp): torch.ops.weir.
// wpack, wdequant, wgather, wgemm, wgemm_parts, wgemm_experts, qpath_available, qpath_best. Built with torch's headers like ops.cpp;
// every tensor and size is checked here before a kernel sees a pointer.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "huge_pages.h"
#include "weir.h"

namespace {

using namespace weir_ops;

// The format is known and k fits its blocks.
void check_format(int64_t format, int64_t k) {
    TORCH_CHECK_VALUE(weir::wformat_known(int(format)), "format: unknown block format ", format);
    const int64_t block = weir::wformat_block(int(format));
    TORCH_CHECK_VALUE(k > 0 && k % block == 0, "k: ", k, " is not a multiple of the format's ",
                      block, "-weight blocks");
}

void check_packed_w(const Tensor& packed, int64_t format, int64_t n, int64_t k, bool gated) {
    check_flat(packed, at::kByte, weir::wpacked_size(int(format), n, k, gated), "packed");
}

// x [rows, k] float32, rows contiguous.
void check_x(const Tensor& x) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.dim() == 2, "x: needs [rows, k], got ", x.sizes());
    check_rows(x, x.size(0), x.size(1), "x");
}

void check_path(int64_t path) {
    TORCH_CHECK_VALUE(path >= weir::kPathAuto && path <= weir::kPathAvx512, "path: 0 to 3");
    TORCH_CHECK_VALUE(weir::qpath_available(int(path)) || path == weir::kPathAuto, "path ", path,
                      " does not run on this CPU");
}

Tensor wpack(const Tensor& rows, const optional<Tensor>& rows2, int64_t format, int64_t n,
             int64_t k) {
    check_format(format, k);
    TORCH_CHECK_VALUE(n > 0, "n: needs at least one row");
    const int64_t bytes = n * weir::wformat_row_bytes(int(format), k);
    check_flat(rows, at::kByte, bytes, "rows");
    if (rows2) check_flat(*rows2, at::kByte, bytes, "rows2");
    Tensor packed = huge_empty({weir::wpacked_size(int(format), n, k, rows2.has_value())}, at::kByte);
    weir::wpack(int(format), rows.data_ptr<uint8_t>(), rows2 ? rows2->data_ptr<uint8_t>() : nullptr,
                n, k, packed.data_ptr<uint8_t>(), threads());
    return packed;
}

Tensor wdequant(const Tensor& packed, int64_t format, int64_t n, int64_t k) {
    check_format(format, k);
    TORCH_CHECK_VALUE(n > 0, "n: needs at least one row");
    check_packed_w(packed, format, n, k, false);
    Tensor out = at::empty({n, k}, packed.options().dtype(at::kFloat));
    weir::wdequant(int(format), packed.data_ptr<uint8_t>(), n, k, out.data_ptr<float>());
    return out;
}

Tensor wgather(const Tensor& packed, int64_t format, int64_t n, int64_t k, const Tensor& rows) {
    check_format(format, k);
    check_packed_w(packed, format, n, k, false);
    check_cpu(rows, "rows");
    TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.is_contiguous(),
                      "rows: needs a contiguous int64 tensor");
    const int64_t count = rows.numel();
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i)
        TORCH_CHECK_INDEX(r[i] >= 0 && r[i] < n, "row ", r[i], " outside the ", n, " rows");
    Tensor out = at::empty({count, k}, packed.options().dtype(at::kFloat));
    if (count > 0)
        weir::wgather(int(format), packed.data_ptr<uint8_t>(), k, r, count, out.data_ptr<float>(),
                      threads());
    return out;
}

Tensor wgemm(const Tensor& x, const Tensor& packed, int64_t format, int64_t n, int64_t gated,
             const optional<Tensor>& bias, const optional<Tensor>& residual, int64_t path) {
    check_x(x);
    const int64_t m = x.size(0), k = x.size(1);
    check_format(format, k);
    TORCH_CHECK_VALUE(gated >= weir::kPlain && gated <= weir::kGeluTanh, "gated: 0 to 3");
    TORCH_CHECK_VALUE(!(gated && bias), "a gated pair takes no bias");
    check_path(path);
    check_packed_w(packed, format, n, k, gated != weir::kPlain);
    if (bias) check_flat(*bias, at::kFloat, n, "bias");
    if (residual) check_rows(*residual, m, gated ? 2 * n : n, "residual");
    Tensor out = at::empty({m, n}, x.options());
    weir::wgemm(int(format), x.data_ptr<float>(), m, k, x.stride(0), packed.data_ptr<uint8_t>(),
                n, int(gated), bias ? bias->data_ptr<float>() : nullptr,
                residual ? residual->data_ptr<float>() : nullptr,
                residual ? residual->stride(0) : 0, out.data_ptr<float>(), n, threads(),
                int(path));
    return out;
}

// Weights sharing x, each in its own format, their outputs side by side in one pass
// (weir.h wgemm_parts): bias and residual over all the outputs.
Tensor wgemm_parts(const Tensor& x, at::TensorList packed, at::IntArrayRef formats,
                   at::IntArrayRef ns, const optional<Tensor>& bias,
                   const optional<Tensor>& residual, int64_t path) {
    check_x(x);
    const int64_t m = x.size(0), k = x.size(1);
    const int64_t count = int64_t(packed.size());
    TORCH_CHECK_VALUE(count >= 1 && count <= 3, "packed: 1 to 3 parts, got ", count);
    TORCH_CHECK_VALUE(int64_t(formats.size()) == count && int64_t(ns.size()) == count,
                      "formats, ns: one per part");
    check_path(path);
    std::vector<weir::WPart> parts;
    int64_t n = 0;
    for (int64_t i = 0; i < count; ++i) {
        check_format(formats[i], k);
        TORCH_CHECK_VALUE(ns[i] > 0, "ns: part ", i, " has no outputs");
        check_packed_w(packed[i], formats[i], ns[i], k, false);
        parts.push_back({int(formats[i]), packed[i].data_ptr<uint8_t>(), ns[i]});
        n += ns[i];
    }
    if (bias) check_flat(*bias, at::kFloat, n, "bias");
    if (residual) check_rows(*residual, m, n, "residual");
    Tensor out = at::empty({m, n}, x.options());
    weir::wgemm_parts(parts.data(), int(count), x.data_ptr<float>(), m, k, x.stride(0),
                      bias ? bias->data_ptr<float>() : nullptr,
                      residual ? residual->data_ptr<float>() : nullptr,
                      residual ? residual->stride(0) : 0, out.data_ptr<float>(), n, threads(),
                      int(path));
    return out;
}

// A mixture's experts (weir.h wgemm_experts): x's rows ordered by expert, counts[i] of them
// expert i's; every expert's weight [n, k] in its own format, each a gated pair when gated.
Tensor wgemm_experts(const Tensor& x, at::TensorList packed, at::IntArrayRef formats, int64_t n,
                     at::IntArrayRef counts, int64_t gated, int64_t path) {
    check_x(x);
    const int64_t m = x.size(0), k = x.size(1);
    const int64_t count = int64_t(packed.size());
    TORCH_CHECK_VALUE(count >= 1, "packed: needs at least one expert");
    TORCH_CHECK_VALUE(int64_t(formats.size()) == count && int64_t(counts.size()) == count,
                      "formats, counts: one per expert");
    TORCH_CHECK_VALUE(n > 0, "n: needs at least one output");
    TORCH_CHECK_VALUE(gated >= weir::kPlain && gated <= weir::kGeluTanh, "gated: 0 to 3");
    check_path(path);
    std::vector<weir::WPart> parts;
    std::vector<int64_t> segments(1, 0);
    for (int64_t i = 0; i < count; ++i) {
        check_format(formats[i], k);
        TORCH_CHECK_VALUE(counts[i] >= 0, "counts: expert ", i, " has ", counts[i], " rows");
        check_packed_w(packed[i], formats[i], n, k, gated != weir::kPlain);
        parts.push_back({int(formats[i]), packed[i].data_ptr<uint8_t>(), n});
        segments.push_back(segments.back() + counts[i]);
    }
    TORCH_CHECK_VALUE(segments.back() == m, "counts: ", segments.back(), " rows of x's ", m);
    Tensor out = at::empty({m, n}, x.options());
    if (m > 0)
        weir::wgemm_experts(parts.data(), int(count), segments.data(), x.data_ptr<float>(), k,
                            x.stride(0), int(gated), out.data_ptr<float>(), n, threads(),
                            int(path));
    return out;
}

bool qpath_available(int64_t path) { return weir::qpath_available(int(path)); }
int64_t qpath_best() { return weir::qpath_best(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(weir, m) {
    m.def("wpack(Tensor rows, Tensor? rows2, int format, int n, int k) -> Tensor", &wpack);
    m.def("wdequant(Tensor packed, int format, int n, int k) -> Tensor", &wdequant);
    m.def("wgather(Tensor packed, int format, int n, int k, Tensor rows) -> Tensor", &wgather);
    m.def("wgemm(Tensor x, Tensor packed, int format, int n, int gated, Tensor? bias, "
          "Tensor? residual, int path) -> Tensor",
          &wgemm);
    m.def("wgemm_parts(Tensor x, Tensor[] packed, int[] formats, int[] ns, Tensor? bias, "
          "Tensor? residual, int path) -> Tensor",
          &wgemm_parts);
    m.def("wgemm_experts(Tensor x, Tensor[] packed, int[] formats, int n, int[] counts, "
          "int gated, int path) -> Tensor",
          &wgemm_experts);
    m.def("qpath_available(int path) -> bool", &qpath_available);
    m.def("qpath_best() -> int", &qpath_best);
}
