"""InternLM3 (InternLM3ForCausalLM, as internlm3-8b-instruct): Llama's model under its own name
and config keys, against transformers, which reads it as Llama's."""

from __future__ import annotations

from tests.test_phi3 import assert_as_transformers, prompt


def test_internlm3_is_served_as_llama(tmp_path):
    """InternLM3ForCausalLM (internlm3-8b-instruct's config, model_type internlm3, read by
    transformers as Llama's): transformers' logits and greedy tokens, its biases drawn."""
    import json

    from gpu.tiny_model import build_tiny_model

    path = build_tiny_model(
        tmp_path / "internlm3", "llama", num_layers=2, attention_bias=True, mlp_bias=True
    )
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["InternLM3ForCausalLM"], model_type="internlm3")
    config["qkv_bias"] = config.pop("attention_bias")
    config["bias"] = config.pop("mlp_bias")
    (path / "config.json").write_text(json.dumps(config))
    assert_as_transformers(path, path, prompt(30), cpu_forward="modules")
