// gpt-oss's parts of one layer of the one-call stack (stack.cpp set_gpt_oss; gpu/models/gpt_oss.py
// computes them on the module path), checked and bound: [o_bias [hidden], sinks [heads],
// router_bias [E], the experts' gate/up biases [E, 2I] and down's [E, hidden]] (empty: none),
// and the clamped SwiGLU's limit and alpha of experts that are plain products. A Llama with
// attention_bias binds its O bias alone this way.
#pragma once

#include <vector>

#include "checks.h"
#include "decoder.h"

namespace weir_ops {

inline void bind_gpt_oss(weir::DecoderLayer& d, const std::vector<Tensor>& L,
                         const weir::DecoderModel& model, float limit, float alpha,
                         std::vector<Tensor>& keep) {
    TORCH_CHECK_VALUE(L.size() == 5, "gpt_oss: five tensors a layer");
    const int64_t E = d.experts, W = 2 * d.expert_intermediate;
    const int64_t sizes[5] = {model.hidden, model.heads, E, E * W, E * model.hidden};
    const char* names[5] = {"o_bias", "sinks", "router_bias", "gate_up_bias", "down_bias"};
    const float* at[5] = {};
    for (int i = 0; i < 5; ++i) {
        if (!L[i].numel()) continue;
        TORCH_CHECK_VALUE(i < 2 || (i == 2 ? E > 0 : d.plain_experts), names[i],
                          ": the layer has no such part");
        check_flat(L[i], at::kFloat, sizes[i], names[i]);
        keep.push_back(L[i]);
        at[i] = L[i].data_ptr<float>();
    }
    TORCH_CHECK_VALUE(!(at[0] && d.post_attn_norm), "o_bias: not beside norms after the blocks");
    d.o_bias = at[0];
    d.sinks = at[1];
    d.router_bias = at[2];
    d.expert_gate_up_bias = at[3];
    d.expert_down_bias = at[4];
    d.swiglu_limit = limit;
    d.swiglu_alpha = alpha;
}

}  // namespace weir_ops
