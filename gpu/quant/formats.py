"""The weight formats weir serves, as GGUF (llama.cpp's ggml) defines them: a row of `k` weights
is k / block_size blocks of block_bytes bytes each.

F32, F16, BF16: plain elements. Q8_0 (32 weights: f16 scale, 32 int8), Q4_0 (32: f16 scale, 16
bytes of nibbles, w = d (q - 8)), Q4_1 (32: f16 d and m, 16 bytes of nibbles, w = d q + m; AWQ
and GPTQ checkpoints are repacked into it and Q4_0: gpu/quant/int4.py), Q5_0 and Q5_1 (Q4_0 and
Q4_1 with a fifth bit: 4 bytes of high bits before the nibbles, w = d (q - 16) or d q + m;
llama-quantize writes them in K-quant files for tensors whose rows are not whole super-blocks of
256, as Qwen2.5-0.5B's 896), and the k-quants over
super-blocks of 256 weights: Q4_K (f16 d and dmin, eight 6-bit scales and mins, 4-bit q:
w = d sc q - dmin m per 32), Q5_K (the same with a fifth bit), Q6_K (16 int8 scales of 16
weights, 6-bit q: w = d sc (q - 32)), Q3_K (16 6-bit scales of 16 weights, 3-bit q:
w = d (sc - 32) (q - 4); Q3_K_S/M/L files and Q2_K's attention), Q2_K (4-bit scales and mins
of 16 weights, 2-bit q: w = d sc q - dmin m); IQ4_NL (32: f16 d, 4-bit indices into sixteen
non-uniform values: w = d v[q]) and IQ4_XS (the same over 256 with a 6-bit scale per 32); IQ3_XXS,
IQ3_S, IQ2_XXS, IQ2_XS and IQ2_S (grids of 4- and 8-tuples, gpu/quant/iq_grids.py: the CPU kernels
take them transcoded into IQ4_XS's layout or one with Q6_K's scales); MXFP4 (32: an E8M0 scale
byte e, 4-bit codes of E2M1 values: w = 2^(e - 128) v[q] with v the values doubled, gpt-oss's
experts; the kernels take it transcoded, gpu/quant/mxfp4.py). The codes are ggml's type
ids; weir's kernels take these names (gpu/cpu/quant.py).
"""

from __future__ import annotations

from typing import NamedTuple


class Format(NamedTuple):
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    block_size: int  # weights per block
    block_bytes: int
    quantized: bool  # blocks of integers and scales (else plain floats)

    def row_bytes(self, k: int) -> int:
        return k // self.block_size * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("f32", 0, 1, 4, False),
        Format("f16", 1, 1, 2, False),
        Format("bf16", 30, 1, 2, False),
        Format("q8_0", 8, 32, 34, True),
        Format("q4_0", 2, 32, 18, True),
        Format("q4_1", 3, 32, 20, True),
        Format("q5_0", 6, 32, 22, True),
        Format("q5_1", 7, 32, 24, True),
        Format("q2_k", 10, 256, 84, True),
        Format("q3_k", 11, 256, 110, True),
        Format("q4_k", 12, 256, 144, True),
        Format("q5_k", 13, 256, 176, True),
        Format("q6_k", 14, 256, 210, True),
        Format("iq4_nl", 20, 32, 18, True),
        Format("iq4_xs", 23, 256, 136, True),
        Format("iq3_xxs", 18, 256, 98, True),
        Format("iq3_s", 21, 256, 110, True),
        Format("iq2_xxs", 16, 256, 66, True),
        Format("iq2_xs", 17, 256, 74, True),
        Format("iq2_s", 22, 256, 82, True),
        Format("mxfp4", 39, 32, 17, True),
    )
}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}
QUANTIZED = [name for name, f in FORMATS.items() if f.quantized]
