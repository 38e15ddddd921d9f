"""LoRA adapters made with PEFT for the tests, and PEFT's greedy tokens as the reference."""

from __future__ import annotations

from pathlib import Path

# name -> (rank, alpha, target modules, rsLoRA): different ranks and targets
ADAPTERS = {
    "qv8": (8, 16, ["q_proj", "v_proj"], False),
    "all16": (16, 32, "all-linear", True),
    "mlp4": (4, 8, ["o_proj", "gate_proj", "down_proj"], False),
}


def make_adapter(base: Path, out: Path, name: str, seed: int = 0) -> Path:
    """A PEFT LoRA adapter of ADAPTERS[name] over the model in `base`, with random A and B (a
    fresh adapter's B is zero: it would change nothing), saved as PEFT saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    r, alpha, targets, rslora = ADAPTERS[name]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in peft_model.named_parameters():
            if "lora_" in key:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts, max_new_tokens: int, logits=False):
    """transformers + PEFT's greedy continuation of each prompt (no EOS stop); with `logits`,
    also each step's logits [steps, vocab] per prompt."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs, all_logits = [], []
    for ids in prompts:
        gen = model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=logits,
            return_dict_in_generate=True,
        )
        outs.append(gen.sequences[0, len(ids) :].tolist())
        if logits:
            all_logits.append(torch.stack([s[0] for s in gen.scores]))
    return (outs, all_logits) if logits else outs
