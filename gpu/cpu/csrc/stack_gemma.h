// Gemma 2's and 3's parts of one layer of the one-call stack (stack.cpp set_gemma;
// gpu/models/gemma.py computes them on the module path), checked and bound: [post_attention_norm,
// pre_feedforward_norm, post_feedforward_norm] (all empty: a plain layer; OLMo 2's
// pre_feedforward_norm alone empty), the layer's window (0: none) and whether it turns with the
// model's second rotation (Gemma 3's sliding layers; SmolLM3's and Cohere 2's unturned ones).
#pragma once

#include <vector>

#include "checks.h"
#include "decoder.h"

namespace weir_ops {

inline void bind_gemma(weir::DecoderLayer& d, const std::vector<Tensor>& N, int64_t window,
                       int64_t local, int64_t H, std::vector<Tensor>& keep) {
    TORCH_CHECK_VALUE(N.size() == 3, "gemma: three norms a layer");
    TORCH_CHECK_VALUE(window >= 0 && (local == 0 || local == 1),
                      "gemma: a window and a 0/1 flag a layer");
    TORCH_CHECK_VALUE(!d.experts || !N[0].numel(), "gemma: norms after the blocks "
                      "beside a mixture of experts");
    if (N[0].numel()) {
        for (int i = 0; i < 3; ++i)  // (OLMo 2's pre_feedforward_norm: none, empty)
            if (i != 1 || N[1].numel()) check_flat(N[i], at::kFloat, H, "gemma norm");
        for (int i = 0; i < 3; ++i) keep.push_back(N[i]);
        d.post_attn_norm = N[0].data_ptr<float>();
        d.pre_ffn_norm = N[1].numel() ? N[1].data_ptr<float>() : nullptr;
        d.post_ffn_norm = N[2].data_ptr<float>();
    }
    d.window = window;
    d.local_rope = int(local);
}

}  // namespace weir_ops
