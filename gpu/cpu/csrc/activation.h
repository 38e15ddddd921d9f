// The activations of a gated MLP (gemm.cpp's and quant.cpp's epilogues): act(gate) * up.
#pragma once

#include <algorithm>
#include <cmath>

#include "weir.h"

namespace weir {

// exp's argument clamped to [-80, 80]: -ffast-math assumes no infinities (exp(-v) overflows
// below v = -88), and above v = 87 exp(-v) is subnormal, which sends glibc's vector exp to its
// scalar fallback for all 16 lanes; at +-80 the results are the same in float32.
inline float silu(float v) { return v / (1.f + std::exp(std::max(-80.f, std::min(-v, 80.f)))); }
inline float gelu(float v) { return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f)); }
inline float gelu_tanh(float v) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return 0.5f * v * (1.f + std::tanh(std::max(-20.f, std::min(u, 20.f))));
}

inline float activate(int gated, float v) {
    return gated == kSilu ? silu(v) : gated == kGelu ? gelu(v) : gelu_tanh(v);
}

}  // namespace weir
