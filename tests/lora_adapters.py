"""LoRA adapters made with PEFT for the tests, PEFT's greedy tokens and logits as the reference,
and the engine the LoRA tests drive."""

from __future__ import annotations

from pathlib import Path

from core.config import EngineConfig
from core.lora import read_adapter
from core.request import EngineRequest
from core.sampling import SamplingParams
from tests.test_correctness import PROMPTS

MAX_TOKENS = 16
LORA_PROMPTS = [PROMPTS[i] for i in (0, 3, 4, 7)]  # 1 to ~60 tokens: the long ones are chunked

# name -> (rank, alpha, target modules, rsLoRA): different ranks and targets
ADAPTERS = {
    "qv8": (8, 16, ["q_proj", "v_proj"], False),
    "all16": (16, 32, "all-linear", True),
    "mlp4": (4, 8, ["o_proj", "gate_proj", "down_proj"], False),
}


def make_adapter(base: Path, out: Path, name: str, seed: int = 0, spec=None) -> Path:
    """A PEFT LoRA adapter of ADAPTERS[name] (or `spec`, in its form) over the model in `base`,
    with random A and B (a fresh adapter's B is zero: it would change nothing), saved as PEFT
    saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    r, alpha, targets, rslora = spec or ADAPTERS[name]
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


def peft_hidden(base, adapter, prompts) -> list:
    """The final hidden states (after the last norm) of each prompt, PEFT's adapter applied."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).get_base_model()
    inner = model.eval().model  # the decoder with PEFT's LoRA layers in place
    with torch.no_grad():
        return [inner(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


_refs: dict = {}


def references(arch, base, adapters, prompts, logits=False):
    """PEFT's greedy tokens per adapter name (None: the base), per prompt of `prompts` (always
    the same ones: LORA_PROMPTS); with `logits`, (tokens, each step's logits) per name."""
    if arch not in _refs:
        _refs[arch] = {
            name: peft_greedy(base, adapters.get(name), prompts, MAX_TOKENS, logits=True)
            for name in [None, *ADAPTERS]
        }
    if logits:
        return _refs[arch]
    return {name: tokens for name, (tokens, _) in _refs[arch].items()}


def engine(base, **kw):
    from gpu.launch import load

    config = dict(model=str(base), dtype="float32", check_integrity=True, enable_lora=True)
    config.update(max_loras=3, max_lora_rank=16)
    return load(EngineConfig(**(config | kw)))


def refs_of(loaded, adapters):
    base = loaded.lora_base
    return {name: read_adapter(name, path, base, 16).ref for name, path in adapters.items()}


def run(core, jobs, max_tokens=MAX_TOKENS, **params):
    """jobs: [(request id, prompt ids, LoraRef or None)]: all added at once, run to the end;
    each request's tokens (with `params` asking for log-probs: its outputs' log-probs too)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    for rid, ids, ref in jobs:
        core.add(EngineRequest(rid, ids, params, lora=ref))
    got = {rid: [] for rid, _, _ in jobs}
    logprobs = {rid: [] for rid, _, _ in jobs}
    while core.has_work:
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
        core.kv.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks
    return (got, logprobs) if params.logprobs is not None else got


TOP = 5  # top log-probs compared


def assert_matches_peft(got, logprobs, want, names, num_prompts, atol=1e-4):
    """Each request "{name}-{i}"'s greedy tokens are PEFT's for its adapter, and every token's
    log-prob and its top TOP alternatives' (from `run(..., logprobs=TOP)`) are PEFT's
    log-softmax of that step's logits within `atol` (absolute and relative). `want`:
    references(..., logits=True)."""
    import torch

    for name in names:
        tokens, logits = want[name]
        for i in range(num_prompts):
            rid = f"{name}-{i}"
            assert got[rid] == tokens[i], rid
            lps = logprobs[rid]
            assert len(lps) == len(tokens[i]), rid
            ref = torch.log_softmax(logits[i].double(), dim=-1)
            mine = torch.tensor([lp.logprob for lp in lps], dtype=torch.float64)
            theirs = ref[torch.arange(len(tokens[i])), torch.tensor(tokens[i])]
            torch.testing.assert_close(
                mine, theirs, atol=atol, rtol=atol, msg=lambda m: f"{rid}: {m}"
            )
            top = torch.tensor([lp.top_logprobs for lp in lps], dtype=torch.float64)
            torch.testing.assert_close(
                top, ref.topk(TOP).values, atol=atol, rtol=atol, msg=lambda m: f"{rid}: {m}"
            )
