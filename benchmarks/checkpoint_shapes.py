"""The model shapes benchmarks/real_checkpoints.py builds (random weights, the tests' trained
tokenizer): `build_tiny_model` keyword arguments per shape name, and the 8B-shaped config its
random Q4_K_M file is written from."""

from __future__ import annotations

SHAPE_1B = dict(
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=8192,
    vocab_size=2048,
    max_position_embeddings=4096,
    initializer_range=0.02,
    dtype="bfloat16",
    extra_eos=("<|endoftext|>",),  # llama.cpp stops there whatever the model says
)
SHAPE_QWEN05 = dict(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    vocab_size=2048,
    model_vocab_size=151936,  # the tokenizer's 2,048 tokens, the rest zero rows (as Qwen pads)
    zero_padding_rows=True,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    initializer_range=0.02,
    dtype="bfloat16",
    extra_eos=("<|endoftext|>",),
)
# Qwen3-30B-A3B's layer (hidden 2048, GQA 32/4 of 128, experts of 768, 8 per token) with 6 layers
# of 32 experts: 1.0B weights, 0.27B of them read per token
SHAPE_MOE = dict(
    hidden_size=2048,
    num_layers=6,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=768,
    num_experts=32,
    experts_per_token=8,
    vocab_size=2048,
    max_position_embeddings=4096,
    initializer_range=0.02,
    dtype="bfloat16",
    extra_eos=("<|endoftext|>",),
)
# Qwen1.5-MoE-A2.7B's layer (hidden 2048, 16 heads of 128 without GQA, experts of 1408, 4 per
# token, never renormalized, a shared expert of 5632) with 6 layers of 16 experts: 1.1B weights,
# 0.52B of them read per token
SHAPE_QWEN2_MOE = dict(
    hidden_size=2048,
    num_layers=6,
    num_heads=16,
    num_kv_heads=16,
    intermediate_size=1408,
    shared_expert_size=5632,
    num_experts=16,
    experts_per_token=4,
    norm_topk_prob=False,
    vocab_size=2048,
    max_position_embeddings=4096,
    initializer_range=0.02,
    dtype="bfloat16",
    extra_eos=("<|endoftext|>",),
)
# Gemma-2-2B's shape (hidden 2304, 26 layers, 8 heads of 256 over 4 KV heads, MLP 9216, every
# other layer a window of 4096, soft caps 50 and 30, a tied 256,000-row embedding: the tokenizer's
# 2,048 tokens and zero rows, as the padding of the other shapes)
SHAPE_GEMMA2 = dict(
    hidden_size=2304,
    num_layers=26,
    num_heads=8,
    num_kv_heads=4,
    head_dim=256,
    intermediate_size=9216,
    sliding_window=4096,
    query_pre_attn_scalar=256,
    vocab_size=2048,
    model_vocab_size=256000,
    zero_padding_rows=True,
    max_position_embeddings=8192,
    initializer_range=0.02,
    dtype="bfloat16",
    extra_eos=("<|endoftext|>",),
)
SHAPES = {"llama-1b": ("llama", "bench-llama-1b-bf16", SHAPE_1B),
          "qwen2.5-0.5b": ("qwen2", "bench-qwen2.5-0.5b-bf16", SHAPE_QWEN05),
          "qwen3-moe": ("qwen3_moe", "bench-qwen3-moe-bf16", SHAPE_MOE),
          "qwen2-moe": ("qwen2_moe", "bench-qwen2-moe-bf16", SHAPE_QWEN2_MOE),
          "gemma2-2b": ("gemma2", "bench-gemma2-2b-bf16", SHAPE_GEMMA2)}  # fmt: skip
# llama.cpp's converter reads Gemma's tokenizer from its sentencepiece file, which these random
# models lack: their files are weir's writer's (gpu/quant/gguf_write.py), which llama-server
# reads as it reads the converter's (tests/test_gemma2.py), and both servers serve the same file.
WEIR_WRITTEN = ("gemma2-2b",)
CONFIG_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
