// The adapters' slots of the one-call stack (stack.cpp set_lora; gpu/lora.py builds them),
// checked and bound: per layer, for each product group in weir.h's LoraGroupId order,
// [a, b, ranks, cols] (an empty a: no adapter modifies that group). Returns the slot count.
#pragma once

#include <vector>

#include "checks.h"
#include "decoder.h"

namespace weir_ops {

inline int64_t bind_lora(std::vector<weir::DecoderLayer>& layers,
                         const std::vector<std::vector<Tensor>>& per_layer,
                         const weir::DecoderModel& model) {
    TORCH_CHECK_VALUE(per_layer.size() == layers.size(), "lora: one entry per layer");
    const int64_t H = model.hidden, qw = model.heads * model.head_dim;
    const int64_t qkvw = qw + 2 * model.kv_heads * model.head_dim, I = model.intermediate;
    const int64_t ks[weir::kLoraGroups] = {H, qw, H, I}, ns[weir::kLoraGroups] = {qkvw, H, 2 * I, H};
    int64_t slots = 0;
    for (size_t li = 0; li < per_layer.size(); ++li) {
        const auto& L = per_layer[li];
        TORCH_CHECK_VALUE(L.size() == 4 * weir::kLoraGroups, "lora: 16 tensors a layer");
        for (int gi = 0; gi < weir::kLoraGroups; ++gi) {
            if (!L[4 * gi].numel()) {
                layers[li].lora[gi] = weir::LoraGroup{};
                continue;
            }
            const weir::LoraGroup g =
                check_lora_group(L[4 * gi], L[4 * gi + 1], L[4 * gi + 2], L[4 * gi + 3]);
            TORCH_CHECK_VALUE(g.k == ks[gi] && g.n == ns[gi], "lora: group ", gi, " is [", g.k,
                              " -> ", g.n, "], the layer's product [", ks[gi], " -> ", ns[gi],
                              "]");
            TORCH_CHECK_VALUE(slots == 0 || g.slots == slots, "lora: one slot count");
            slots = g.slots;
            layers[li].lora[gi] = g;
        }
    }
    return slots;
}

}  // namespace weir_ops
