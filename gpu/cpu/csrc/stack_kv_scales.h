// A checkpoint's FP8 KV cache scales on one layer of the one-call stack (stack.cpp
// set_kv_scales; gpu/kv_scales.py computes them, and applies them on the module path): [k_mul,
// v_mul, score_scale, out_scale] as float32 values (K and V times k_mul and v_mul before their
// cache writes, the scores by score_scale in place of the model's scale, the attention's output
// times out_scale), or none: the layer is unscaled (all 0, forward.cpp's test).
#pragma once

#include <vector>

#include "checks.h"
#include "decoder.h"

namespace weir_ops {

inline void bind_kv_scales(weir::DecoderLayer& d, const std::vector<double>& S) {
    TORCH_CHECK_VALUE(S.empty() || S.size() == 4, "kv scales: four values a layer, or none");
    for (double s : S) TORCH_CHECK_VALUE(s > 0, "kv scales: positive values");
    d.k_mul = S.empty() ? 0.f : float(S[0]);
    d.v_mul = S.empty() ? 0.f : float(S[1]);
    d.score_scale = S.empty() ? 0.f : float(S[2]);
    d.out_scale = S.empty() ? 0.f : float(S[3]);
}

}  // namespace weir_ops
