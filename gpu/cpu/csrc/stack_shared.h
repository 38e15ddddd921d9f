// Qwen2-MoE's shared expert beside one layer's mixture in the one-call stack (stack.cpp
// set_shared; gpu/models/moe.py computes it on the module path), checked and bound: [gate_up0,
// gate_up1, down, gate] and their formats [gate_up0, gate_up1 (-1: gate_up0 is the packed
// pair), down, gate, intermediate]. The expert's MLP takes the mixture layer's unused gate_up
// and down; its gate is one logit [1, hidden].
#pragma once

#include <vector>

#include "checks.h"
#include "decoder.h"

namespace weir_ops {

// A gated MLP's gate and up [n, k] each: one packed pair (format1 < 0), or gate then up.
inline weir::StackLinear gated_pair(int64_t format0, const Tensor& t0, int64_t format1,
                                    const Tensor& t1, int64_t n, int64_t k, const char* name) {
    weir::StackLinear w{};
    w.part[w.parts++] = stack_weight(format0, t0, n, k, format1 < 0, name);
    if (format1 >= 0) w.part[w.parts++] = stack_weight(format1, t1, n, k, false, name);
    return w;
}

inline void bind_shared(weir::DecoderLayer& d, const std::vector<Tensor>& L,
                        const std::vector<int64_t>& F, int64_t H, std::vector<Tensor>& keep) {
    TORCH_CHECK_VALUE(L.size() == 4 && F.size() == 5, "shared: 4 tensors, 5 formats");
    TORCH_CHECK_VALUE(d.experts > 0, "shared: an expert beside a mixture only");
    const int64_t S = F[4];
    TORCH_CHECK_VALUE(S > 0, "shared: intermediate ", S);
    d.gate_up = gated_pair(F[0], L[0], F[1], L[1], S, H, "shared gate_up");
    d.down.part[0] = stack_weight(F[2], L[2], H, S, false, "shared down");
    d.down.parts = 1;
    d.shared_gate = stack_weight(F[3], L[3], 1, H, false, "shared expert gate");
    d.shared_intermediate = S;
    for (const auto& t : L) keep.push_back(t);
}

}  // namespace weir_ops
