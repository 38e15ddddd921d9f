"""Decoder-only transformer models in plain torch: Llama (and Mistral), Qwen2, Qwen3."""
