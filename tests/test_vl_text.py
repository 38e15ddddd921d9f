"""The text model of Qwen's vision-language checkpoints (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration: Qwen2.5-VL-3B/7B,
Qwen3-VL-2B/4B/8B), served alone (gpu/text_of.py; the vision tower is not loaded and a request
with an image is refused): over text, their multimodal rotation (M-RoPE, interleaved in Qwen3-VL)
turns every frequency by the one position a text token has, which is Qwen2's and Qwen3's
rotation. Checked against transformers' own vision-language model on text: the logits after a
prompt and six greedy tokens; the LM head tied or not as the checkpoint holds it."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.test_phi3 import first_logits, prompt

VISION = {  # one tiny layer of each family's tower (never loaded by weir)
    "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                       out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, fullatt_block_indexes=[0]),
    "qwen3_vl": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                     out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                     temporal_patch_size=2, deepstack_visual_indexes=[0],
                     num_position_embeddings=16),
}  # fmt: skip


def vision_language(root, kind: str, tie: bool):
    """A tiny vision-language checkpoint of `kind` around a tiny text model; (its folder, the
    transformers model)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from gpu.tiny_model import build_tiny_model

    arch = "qwen3" if kind == "qwen3_vl" else "qwen2"
    text = build_tiny_model(root / f"{kind}-text", arch, num_layers=2, tie_word_embeddings=tie)
    lm = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    tc = {k: v for k, v in lm.config.to_dict().items()
          if k not in ("architectures", "model_type", "transformers_version", "dtype")}  # fmt: skip
    tc["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]}  # fmt: skip
    if kind == "qwen3_vl":
        tc["rope_parameters"]["mrope_interleaved"] = True
    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[kind]
    config = getattr(transformers, f"{names}Config")(
        text_config=tc, vision_config=VISION[kind], image_token_id=1020, video_token_id=1021,
        vision_start_token_id=1022, tie_word_embeddings=tie,
    )  # fmt: skip
    both = getattr(transformers, f"{names}ForConditionalGeneration")(config)
    both.model.language_model.load_state_dict(lm.model.state_dict())
    if not tie:
        both.lm_head.load_state_dict(lm.lm_head.state_dict())
    out = root / kind
    both.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / f, out / f)
    return out, both.eval()


@pytest.mark.parametrize(
    "kind,tie", [("qwen2_vl", True), ("qwen2_5_vl", False), ("qwen3_vl", True)]
)
def test_the_text_of_a_vision_language_checkpoint(tmp_path, kind, tie):
    path, model = vision_language(tmp_path, kind, tie)
    ids = prompt(30)
    got, tokens = first_logits(path, ids, num_kv_blocks=64)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0, -1]
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch,gguf_arch", [("qwen2", "qwen2vl"), ("qwen3", "qwen3vl")])
def test_the_text_model_of_a_vision_language_gguf_file(tmp_path, arch, gguf_arch):
    """llama.cpp's converter writes a vision-language model's text as "qwen2vl" or "qwen3vl"
    (its tower in a separate mmproj file), its rotation's sections as metadata (checked against
    its files: weir and llama-server give transformers' tokens on them): served as Qwen2's and
    Qwen3's text model, transformers' logits and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf
    from gpu.tiny_model import build_tiny_model
    from tests.test_phi3 import assert_as_transformers

    hf = build_tiny_model(tmp_path / arch, arch, num_layers=2)
    path = write_gguf(hf, tmp_path / f"{gguf_arch}.gguf", uniform("f32"), arch=gguf_arch)
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == gguf_arch and ckpt.get(f"{gguf_arch}.rope.dimension_sections")
    assert_as_transformers(path, hf, prompt(30))
