// Products on weights in 16-bit and block formats (GGUF's F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K) packed into weir's panels (quant_pack.cpp): the reference product,
// the quantization of the activations, and the dispatch to the fastest path this CPU runs
// (quant_avx512.cpp with VNNI and BF16, quant_avx2.cpp), each tested against the reference. The
// layout and the arithmetic every path shares: quant_layout.h.
//
// A product streams each panel once per chunk of up to kRowChunk rows: a decode step or a
// prefill chunk reads every weight block once for all its rows, so many streams cost arithmetic,
// not memory bandwidth.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "activation.h"
#include "quant_layout.h"
#include "weir.h"

namespace weir {

using namespace q;

namespace q {

void panel_ref(int format, const uint8_t* panel, const Acts& a, const void* x16,
               int64_t x16_stride, int64_t rows, float* out) {
    if (is_half(format)) {
        const uint16_t* w = reinterpret_cast<const uint16_t*>(panel);
        for (int64_t r = 0; r < rows; ++r) {
            float e[kHalfSums][kPanel] = {};
            for (int64_t p = 0; p < a.k / 2; ++p) {
                float x0, x1;
                if (format == kWBF16) {
                    const uint16_t* xb = static_cast<const uint16_t*>(x16) + r * x16_stride;
                    x0 = bf16_to_float(xb[2 * p]);
                    x1 = bf16_to_float(xb[2 * p + 1]);
                } else {
                    const float* xf = static_cast<const float*>(x16) + r * x16_stride;
                    x0 = xf[2 * p];
                    x1 = xf[2 * p + 1];
                }
                float* o = e[p % kHalfSums];
                for (int c = 0; c < kPanel; ++c) {
                    const uint16_t* wc = w + (p * kPanel + c) * 2;
                    const float w0 = format == kWBF16 ? bf16_to_float(wc[0]) : half_to_float(wc[0]);
                    const float w1 = format == kWBF16 ? bf16_to_float(wc[1]) : half_to_float(wc[1]);
                    o[c] = std::fma(x1, w1, o[c]);
                    o[c] = std::fma(x0, w0, o[c]);
                }
            }
            for (int c = 0; c < kPanel; ++c)
                out[r * kPanel + c] = e[0][c] + e[1][c];
        }
        return;
    }
    const Geometry g = geometry(format);
    const int64_t blocks = a.k / 32;
    const uint8_t* at = panel;
    const uint8_t* header = nullptr;
    std::vector<float> sums(rows * 2 * kPanel, 0.f);  // [row][b % 2][column]
    BlockView v;
    for (int64_t b = 0; b < blocks; ++b) {
        if (g.header && b % 8 == 0) {
            header = at;
            at += g.header;
        }
        read_block(format, header, at, at + g.scales, v);
        at += g.scales + g.ints;
        for (int64_t r = 0; r < rows; ++r) {
            const int8_t* xq = a.xq + r * a.k + b * 32;
            const int64_t blk = r * blocks + b;
            for (int c = 0; c < kPanel; ++c) {
                float& e = sums[(r * 2 + b % 2) * kPanel + c];
                if (g.halves == 2) {
                    for (int h = 0; h < 2; ++h) {
                        int32_t dot = 0;
                        for (int kk = 16 * h; kk < 16 * h + 16; ++kk) dot += int32_t(xq[kk]) * v.u[c][kk];
                        e = update(e, dot, v.alpha[c][h], v.beta[c][h], a.dx[blk],
                                   a.xs16[2 * blk + h]);
                    }
                } else {
                    int32_t dot = 0;
                    for (int kk = 0; kk < 32; ++kk) dot += int32_t(xq[kk]) * v.u[c][kk];
                    e = update(e, dot, v.alpha[c][0], v.beta[c][0], a.dx[blk], a.xs[blk]);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < kPanel; ++c)
            out[r * kPanel + c] = sums[(r * 2) * kPanel + c] + sums[(r * 2 + 1) * kPanel + c];
}

}  // namespace q
namespace {

// Rows of x, per 32: dx = amax / 127, xq = x / dx rounded to nearest even, the sums.
void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t stride, int8_t* xq,
                   float* dx, int32_t* sum, float* xs, float* xs16) {
    const int64_t blocks = k / 32;
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * stride;
        for (int64_t b = 0; b < blocks; ++b) {
            const float* v = xr + 32 * b;
            float amax = 0.f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
            const float d = amax / 127.f;
            const float id = d > 0.f ? 1.f / d : 0.f;
            int8_t* q = xq + r * k + 32 * b;
            int32_t s[2] = {0, 0};
            for (int i = 0; i < 32; ++i) {
                const int32_t qi = int32_t(std::nearbyint(v[i] * id));
                q[i] = int8_t(std::max(-127, std::min(127, qi)));
                s[i / 16] += q[i];
            }
            const int64_t blk = r * blocks + b;
            dx[blk] = d;
            sum[blk] = s[0] + s[1];
            xs[blk] = d * float(s[0] + s[1]);
            xs16[2 * blk] = d * float(s[0]);
            xs16[2 * blk + 1] = d * float(s[1]);
        }
    }
}

bool cpu_has(const char* feature) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!std::strcmp(feature, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!std::strcmp(feature, "avx512"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx512bf16");
#endif
    (void)feature;
    return false;
}

}  // namespace
bool qpath_available(int path) {
    switch (path) {
        case kPathRef: return true;
        case kPathAvx2: return cpu_has("avx2");
        case kPathAvx512: return cpu_has("avx512");
        default: return false;
    }
}

int qpath_best() {
    static const int best = qpath_available(kPathAvx512) ? kPathAvx512
                            : qpath_available(kPathAvx2) ? kPathAvx2
                                                         : kPathRef;
    return best;
}

namespace {

// Parts' products over one pass of the threads (wgemm, wgemm_parts, wgemm_experts): `count`
// parts side by side, each over all m rows, or one gated pair (count 1, gated: gate and up panels
// side by side); with `segments` (count + 1 row offsets), part i over rows [segments[i],
// segments[i + 1]) only, every part's outputs in the same columns (a mixture's experts, each a
// gated pair when gated).
void products(const WPart* parts, int count, const float* x, int64_t m, int64_t k,
              int64_t x_stride, int gated, const float* bias, const float* residual,
              int64_t res_stride, float* out, int64_t out_stride, int64_t num_threads, int path,
              const int64_t* segments = nullptr) {
    if (m <= 0) return;
    if (path == kPathAuto) path = qpath_best();
    PanelFn fn = panel_ref;
#if defined(__x86_64__)
    if (path == kPathAvx512) fn = panel_avx512;
    if (path == kPathAvx2) fn = panel_avx2;
#endif
    const int64_t chunks = (m + kRowChunk - 1) / kRowChunk;
    const int64_t pair = gated ? 2 : 1;  // a gated pair: gate and up panels side by side
    bool bf16 = false, blocks = false;
    for (int i = 0; i < count; ++i) {
        bf16 |= parts[i].format == kWBF16;
        blocks |= !is_half(parts[i].format);
    }
    // the activations, in the forms the weights' products take them
    std::vector<int8_t> xq;
    std::vector<float> dx, xs, xs16;
    std::vector<int32_t> sums;
    std::vector<uint16_t> xb;
    std::vector<float> xbf;  // the AVX2 path (no bf16 product) takes them as floats, once rounded
    const bool bf16_floats = bf16 && path == kPathAvx2;
    if (bf16) {
        if (bf16_floats) xbf.resize(m * k);
        else xb.resize(m * k);
        parallel_for(m, m > 8 ? num_threads : 1, [&](int64_t r) {
            for (int64_t kk = 0; kk < k; ++kk) {
                const uint16_t b = float_to_bf16(x[r * x_stride + kk]);
                if (bf16_floats) xbf[r * k + kk] = bf16_to_float(b);
                else xb[r * k + kk] = b;
            }
        });
    }
    if (blocks) {
        xq.resize(m * k);
        dx.resize(m * k / 32);
        sums.resize(m * k / 32);
        xs.resize(m * k / 32);
        xs16.resize(m * k / 16);
        parallel_for(chunks, num_threads, [&](int64_t c) {
            const int64_t r0 = c * kRowChunk, rows = std::min(kRowChunk, m - r0);
            quantize_rows(x + r0 * x_stride, rows, k, x_stride, xq.data() + r0 * k,
                          dx.data() + r0 * k / 32, sums.data() + r0 * k / 32,
                          xs.data() + r0 * k / 32, xs16.data() + r0 * k / 16);
        });
    }
    // A task: a run of one part's panels for one chunk of its rows; about 16 tasks a thread, so
    // that a thread another process preempts holds up little, without a task per panel's
    // dispatch cost. Runs never cross parts; col[i]: part i's first output.
    auto rows_of = [&](int i) -> std::pair<int64_t, int64_t> {
        return segments ? std::make_pair(segments[i], segments[i + 1]) : std::make_pair(int64_t(0), m);
    };
    int64_t work = 0;
    for (int i = 0; i < count; ++i) {
        const auto [lo, hi] = rows_of(i);
        work += (parts[i].n + kPanel - 1) / kPanel * ((hi - lo + kRowChunk - 1) / kRowChunk);
    }
    const int64_t group = std::max<int64_t>(1, work / (16 * std::max<int64_t>(1, num_threads)));
    struct Task {
        int part;
        int64_t p0, p1, r0, rows;
    };
    std::vector<Task> tasks;
    std::vector<int64_t> col(count + 1, 0);
    for (int i = 0; i < count; ++i) col[i + 1] = segments ? 0 : col[i] + parts[i].n;
    for (int64_t c = 0; c < chunks; ++c) {  // the rows' chunks, outermost (as without segments)
        for (int i = 0; i < count; ++i) {
            const auto [lo, hi] = rows_of(i);
            const int64_t r0 = lo + c * kRowChunk;
            if (r0 >= hi) continue;
            const int64_t panels = (parts[i].n + kPanel - 1) / kPanel;
            for (int64_t p0 = 0; p0 < panels; p0 += group)
                tasks.push_back({i, p0, std::min(panels, p0 + group), r0,
                                 std::min(kRowChunk, hi - r0)});
        }
    }
    const int64_t ntasks = int64_t(tasks.size());
    parallel_for(ntasks, ntasks > 1 ? num_threads : 1, [&](int64_t t) {
        const Task& task = tasks[t];
        const int i = task.part;
        const WPart& w = parts[i];
        const int64_t n = w.n;
        const int64_t bytes = panel_bytes(w.format, k);
        const int64_t p0 = task.p0, p1 = task.p1, r0 = task.r0, rows = task.rows;
        alignas(64) float acc[2][kRowChunk * kPanel];
        Acts a{nullptr, nullptr, nullptr, nullptr, nullptr, k};
        const void* x16 = nullptr;
        int64_t x16_stride = 0;
        if (w.format == kWBF16) {
            x16 = bf16_floats ? static_cast<const void*>(xbf.data() + r0 * k) : xb.data() + r0 * k;
            x16_stride = k;
        } else if (is_half(w.format)) {
            x16 = x + r0 * x_stride;
            x16_stride = x_stride;
        } else {
            a = Acts{xq.data() + r0 * k, dx.data() + r0 * k / 32, sums.data() + r0 * k / 32,
                     xs.data() + r0 * k / 32, xs16.data() + r0 * k / 16, k};
        }
        // this part's outputs, bias and residual columns
        float* part_out = out + col[i];
        const float* part_bias = bias ? bias + col[i] : nullptr;
        const float* part_res = residual ? residual + col[i] : nullptr;
        for (int64_t p = p0; p < p1; ++p) {
            for (int64_t half = 0; half < pair; ++half)
                fn(w.format, w.packed + (p * pair + half) * bytes, a, x16, x16_stride, rows,
                   acc[half]);
            const int64_t n0 = p * kPanel, cols = std::min(kPanel, n - n0);
            for (int64_t r = 0; r < rows; ++r) {
                float* o = part_out + (r0 + r) * out_stride + n0;
                const float* g = acc[0] + r * kPanel;
                const float* res = part_res ? part_res + (r0 + r) * res_stride + n0 : nullptr;
                if (gated) {
                    const float* u = acc[1] + r * kPanel;
                    if (res) {  // a pre-activation addend [m, 2n]: gate's, then up's
                        for (int64_t j = 0; j < cols; ++j)
                            o[j] = activate(gated, g[j] + res[j]) * (u[j] + res[n + j]);
                        continue;
                    }
                    for (int64_t j = 0; j < cols; ++j) o[j] = activate(gated, g[j]) * u[j];
                    continue;
                }
                for (int64_t j = 0; j < cols; ++j) {
                    float v = g[j];
                    if (part_bias) v += part_bias[n0 + j];
                    if (res) v += res[j];
                    o[j] = v;
                }
            }
        }
    });
}

}  // namespace

void wgemm(int format, const float* x, int64_t m, int64_t k, int64_t x_stride,
           const uint8_t* packed, int64_t n, int gated, const float* bias, const float* residual,
           int64_t res_stride, float* out, int64_t out_stride, int64_t num_threads, int path) {
    const WPart part{format, packed, n};
    products(&part, 1, x, m, k, x_stride, gated, bias, residual, res_stride, out, out_stride,
             num_threads, path);
}

void wgemm_parts(const WPart* parts, int count, const float* x, int64_t m, int64_t k,
                 int64_t x_stride, const float* bias, const float* residual, int64_t res_stride,
                 float* out, int64_t out_stride, int64_t num_threads, int path) {
    products(parts, count, x, m, k, x_stride, 0, bias, residual, res_stride, out, out_stride,
             num_threads, path);
}

void wgemm_experts(const WPart* experts, int count, const int64_t* segments, const float* x,
                   int64_t k, int64_t x_stride, int gated, float* out, int64_t out_stride,
                   int64_t num_threads, int path) {
    products(experts, count, x, segments[count], k, x_stride, gated, nullptr, nullptr, 0, out,
             out_stride, num_threads, path, segments);
}

}  // namespace weir
