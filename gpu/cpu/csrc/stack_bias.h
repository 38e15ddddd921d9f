// The biases of the one-call stack's norms and ungated MLPs (stack.cpp set_norm_bias and
// set_mlp_bias), checked and bound: a layer norm's bias, per layer [input_norm, post_norm]
// (empty: none) and the final norm's (Nemotron's, StarCoder2's); an ungated MLP's, per layer
// [up bias [intermediate], down bias [hidden]] (StarCoder2's).
#pragma once

#include <vector>

#include "checks.h"
#include "decoder.h"

namespace weir_ops {

inline void bind_norm_bias(std::vector<weir::DecoderLayer>& layers,
                           const std::vector<std::vector<Tensor>>& per_layer,
                           const Tensor& final_bias, weir::DecoderModel& model,
                           std::vector<Tensor>& keep) {
    TORCH_CHECK_VALUE(per_layer.size() == layers.size(), "norm bias: one entry per layer");
    auto bind = [&](const Tensor& t) -> const float* {
        if (!t.numel()) return nullptr;
        check_flat(t, at::kFloat, model.hidden, "norm bias");
        keep.push_back(t);
        return t.data_ptr<float>();
    };
    for (size_t li = 0; li < layers.size(); ++li) {
        TORCH_CHECK_VALUE(per_layer[li].size() == 2, "norm bias: two a layer");
        layers[li].input_norm_bias = bind(per_layer[li][0]);
        layers[li].post_norm_bias = bind(per_layer[li][1]);
    }
    model.final_norm_bias = bind(final_bias);
}

inline void bind_mlp_bias(std::vector<weir::DecoderLayer>& layers,
                          const std::vector<std::vector<Tensor>>& per_layer,
                          const weir::DecoderModel& model, std::vector<Tensor>& keep) {
    TORCH_CHECK_VALUE(per_layer.size() == layers.size(), "mlp bias: one entry per layer");
    for (size_t li = 0; li < layers.size(); ++li) {
        const auto& B = per_layer[li];
        auto& d = layers[li];
        TORCH_CHECK_VALUE(B.size() == 2 && d.plain_up, "mlp bias: two, an ungated MLP's");
        check_flat(B[0], at::kFloat, model.intermediate, "up bias");
        check_flat(B[1], at::kFloat, model.hidden, "down bias");
        d.up_bias = B[0].data_ptr<float>();
        d.down_bias = B[1].data_ptr<float>();
        keep.push_back(B[0]);
        keep.push_back(B[1]);
    }
}

}  // namespace weir_ops
