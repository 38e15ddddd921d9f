"""The text model of a multimodal checkpoint (Gemma 3's 4B-27B, `Gemma3ForConditionalGeneration`;
Mistral 3's, `Mistral3ForConditionalGeneration`: Mistral Small 3.1 and 3.2, Magistral Small,
Ministral 3), served alone: its language model's config and weights, under the names of the
text-only architecture (by the text config's model_type); the vision tower and its projector are
not loaded (weir takes no images: a request with one is refused), which start-up says once."""

from __future__ import annotations

import logging
from typing import Any

from core.config import CheckpointError

log = logging.getLogger("weir")

# multimodal architecture -> its text config's model_type -> the text-only architecture
TEXT_OF = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Mistral3ForConditionalGeneration": {
        "mistral": "MistralForCausalLM",
        "ministral3": "Ministral3ForCausalLM",
    },
    # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's text models turn by their multimodal rotation
    # (M-RoPE: a time, height and width position each over its own frequencies); a text token's
    # three positions are one and the same, so over text it is Qwen2's and Qwen3's rotation
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
}
# the language model's tensors, in the checkpoints' layout and in transformers 5's
_RENAMED = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_OTHER = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_OTHER += ("model.multi_modal_projector.", "visual.", "model.visual.")


def text_config(config: Any, head: bool | None = None) -> Any:
    """`config`, or its text model's config when it is a multimodal checkpoint weir serves the
    text of (marked `weir_text_of` for the loader). `head`: whether the checkpoint holds an LM
    head, which says whether its text model ties it to the embeddings (transformers 5 keeps that
    flag at the multimodal config's top, whose default ties for some families whose released
    files hold a head; None: the text config's own flag)."""
    archs = getattr(config, "architectures", None) or []
    multimodal = next((a for a in archs if a in TEXT_OF), None)
    if multimodal is None:
        return config
    text = config.text_config
    kind = getattr(text, "model_type", None)
    if kind not in TEXT_OF[multimodal]:
        raise CheckpointError(
            f"{multimodal} with a {kind!r} text model is not served; weir serves the text of "
            f"{', '.join(TEXT_OF[multimodal])}"
        )
    text.architectures = [TEXT_OF[multimodal][kind]]
    if head is not None:
        text.tie_word_embeddings = not head
    text.weir_text_of = multimodal
    for shared in ("dtype", "quantization_config"):  # the checkpoint's, kept at its top
        if getattr(text, shared, None) is None and getattr(config, shared, None) is not None:
            setattr(text, shared, getattr(config, shared))
    log.info("%s: serving its text model (images are refused; the vision tower is not loaded)",
             multimodal)  # fmt: skip
    return text


def text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the text model's name; None for the other
    towers' tensors (not loaded)."""
    for old, new in _RENAMED:
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith(_OTHER):
        return None
    return name
