// A mixture of experts inside the one-call layer stack (forward.cpp): what gpu/models/moe.py
// computes with torch ops around two backend calls, here without leaving C++.
//
//   logits = h Wr^T (+ b); p = softmax(logits) in float32; each token's top_k experts by p (best first,
//   the lower expert on a tie), their p renormalized over the k when asked; the (token, choice)
//   pairs ordered by expert (tokens in order within one); gate/up and down of every expert used
//   in one wgemm_experts pass each (p times weight_scale: Granite's residual factor);
//   x[token] += sum over its choices, best first, of p * out
//   (plus, for Qwen2-MoE, sigmoid(its shared gate's logit) * the shared expert's out). gpt-oss's
//   experts (plain_experts) as gpu/models/gpt_oss.py computes them: gate/up a plain product,
//   its bias, the clamped SwiGLU, down and its bias.
//
// The routing's float operations are not torch's (its softmax's exp is vectorized), so the stack
// and the module path may differ in the last bits of a token's weights (tests/test_moe.py holds
// them close); the experts' products are the same kernels on the same rows.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "decoder.h"

namespace weir {

namespace {

// gpt-oss's experts over the pairs' rows (ordered by expert): gate/up [pairs, 2I] plain, each
// row's expert's bias added and the clamped SwiGLU written into its first I (in place: column j
// reads columns j and I + j alone), down over those (rows 2I apart), then down's bias.
void plain_experts(const DecoderLayer& L, const std::vector<WPart>& gate_up,
                   const std::vector<WPart>& down, const std::vector<int64_t>& segments,
                   int64_t pairs, int64_t H, const MoeScratch& s, int64_t nt) {
    const int64_t I = L.expert_intermediate, W = 2 * I;
    const int used = int(gate_up.size());
    wgemm_experts(gate_up.data(), used, segments.data(), s.rows, H, H, kPlain, s.gated, W, nt,
                  kPathAuto);
    const float limit = L.swiglu_limit, alpha = L.swiglu_alpha;
    const float* gb = L.expert_gate_up_bias;
    parallel_for(pairs, pairs > 8 ? nt : 1, [&](int64_t r) {
        float* g = s.gated + r * W;
        const float* b = gb ? gb + s.chosen[s.order[r]] * W : nullptr;
        for (int64_t j = 0; j < I; ++j) {
            const float gate = std::min(b ? g[j] + b[j] : g[j], limit);
            const float up = std::max(-limit, std::min(b ? g[I + j] + b[I + j] : g[I + j], limit));
            // exp's argument kept finite, as activation.h's silu keeps it
            const float e = std::exp(std::max(-80.f, std::min(-gate * alpha, 80.f)));
            g[j] = (up + 1.f) * (gate * (1.f / (1.f + e)));
        }
    });
    wgemm_experts(down.data(), used, segments.data(), s.gated, I, W, kPlain, s.outs, H, nt,
                  kPathAuto);
    if (const float* db = L.expert_down_bias)
        parallel_for(pairs, pairs > 8 ? nt : 1, [&](int64_t r) {
            const float* b = db + s.chosen[s.order[r]] * H;
            float* y = s.outs + r * H;
            for (int64_t d = 0; d < H; ++d) y[d] = y[d] + b[d];
        });
}

}  // namespace

void moe_block(const DecoderLayer& L, const float* h, int64_t T, int64_t H, float* x,
               const MoeScratch& s, int act, int64_t nt, const float* shared,
               const float* shared_logit, float weight_scale) {
    const int64_t E = L.experts, K = L.top_k, I = L.expert_intermediate;
    // the router's logits [T, E]
    if (L.router.format == kWF32)
        gemm(h, T, H, H, static_cast<const float*>(L.router.data), E, 0, L.router_bias, nullptr,
             0, s.logits, E, nt);
    else
        wgemm(L.router.format, h, T, H, H, static_cast<const uint8_t*>(L.router.data), E, 0,
              L.router_bias, nullptr, 0, s.logits, E, nt, kPathAuto);
    // each token's softmax, its top K (repeated selection: K and E are small), renormalized
    std::fill(s.counts, s.counts + E + 1, 0);
    for (int64_t t = 0; t < T; ++t) {
        float* p = s.logits + t * E;
        float top = p[0];
        for (int64_t e = 1; e < E; ++e) top = std::max(top, p[e]);
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - top));
        for (int64_t e = 0; e < E; ++e) p[e] /= sum;
        float* w = s.weights + t * K;
        int32_t* c = s.chosen + t * K;
        for (int64_t j = 0; j < K; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                bool taken = false;
                for (int64_t i = 0; i < j; ++i) taken |= c[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            c[j] = int32_t(best);
            w[j] = p[best];
            ++s.counts[best + 1];
        }
        if (L.renormalize) {
            float total = 0.f;
            for (int64_t j = 0; j < K; ++j) total += w[j];
            for (int64_t j = 0; j < K; ++j) w[j] /= total;
        }
        if (weight_scale != 1.f)  // Granite's residual factor (the module path's order)
            for (int64_t j = 0; j < K; ++j) w[j] *= weight_scale;
    }
    // the pairs by expert: counts become each expert's first row (a counting sort, stable)
    for (int64_t e = 0; e < E; ++e) s.counts[e + 1] += s.counts[e];
    std::vector<int64_t> next(s.counts, s.counts + E);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < K; ++j) s.order[next[s.chosen[t * K + j]]++] = t * K + j;
    const int64_t pairs = T * K;
    parallel_for(pairs, pairs > 64 ? nt : 1, [&](int64_t r) {
        std::memcpy(s.rows + r * H, h + (s.order[r] / K) * H, sizeof(float) * H);
    });
    // the experts used, their rows' segments
    std::vector<WPart> gate_up, down;
    std::vector<int64_t> segments(1, 0);
    for (int64_t e = 0; e < E; ++e) {
        if (s.counts[e + 1] == s.counts[e]) continue;
        gate_up.push_back(L.expert_gate_up[e]);
        down.push_back(L.expert_down[e]);
        segments.push_back(s.counts[e + 1]);
    }
    const int used = int(gate_up.size());
    if (L.plain_experts) {
        plain_experts(L, gate_up, down, segments, pairs, H, s, nt);
    } else {
        wgemm_experts(gate_up.data(), used, segments.data(), s.rows, H, H, act, s.gated, I, nt,
                      kPathAuto);
        wgemm_experts(down.data(), used, segments.data(), s.gated, I, I, kPlain, s.outs, H, nt,
                      kPathAuto);
    }
    // back in (token, choice) order: where each pair's output row is; x += the weighted sum
    std::vector<int64_t> at(pairs);
    for (int64_t r = 0; r < pairs; ++r) at[s.order[r]] = r;
    parallel_for(T, T > 8 ? nt : 1, [&](int64_t t) {
        float* xt = x + t * H;
        float* acc = s.rows + t * K * H;  // this token's input rows are no longer read
        for (int64_t j = 0; j < K; ++j) {
            const float* y = s.outs + at[t * K + j] * H;
            const float w = s.weights[t * K + j];
            for (int64_t d = 0; d < H; ++d) acc[d] = j ? acc[d] + y[d] * w : y[d] * w;
        }
        if (shared) {  // the module path's out + sigmoid(logit) * shared, then x + out
            const float w = 1.f / (1.f + std::exp(-shared_logit[t]));
            const float* y = shared + t * H;
            for (int64_t d = 0; d < H; ++d) acc[d] = acc[d] + w * y[d];
        }
        for (int64_t d = 0; d < H; ++d) xt[d] += acc[d];
    });
}

}  // namespace weir
