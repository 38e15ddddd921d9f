"""All layers in one compiled call (gpu/cpu/forward.py) against the module-by-module path: the
same kernels in the same order, so every step's logits are bitwise the same."""

from __future__ import annotations

import msgspec
import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load
from tests.conftest import ARCHS

PROMPTS = [
    "hello",
    "the model is a server " * 5,
    "café naïve résumé 你好 世界 😀 🎉",
    "token " * 40,
    "x",
]


def load_both(path, **pool):
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", **pool)
    fused = load(msgspec.structs.replace(config, cpu_forward="fused"))
    modules = load(msgspec.structs.replace(config, cpu_forward="modules"))
    return fused, modules


# Mistral with a sliding window of 8 under the prompts above: the window applies in the kernel.
# A 16-bit or FP8 KV cache (--kv-cache-dtype): K/V rounded as torch's .to() rounds, read widened.
@pytest.mark.parametrize(
    "arch,extra,kv",
    [
        *((a, {}, "auto") for a in ARCHS),
        ("mistral", {"sliding_window": 8}, "auto"),
        # Gemma 3: norms after the blocks, scaled embeddings, its attention scale, sliding
        # layers (a window of 8) with their own rotation beside a global one
        ("gemma3", {"num_layers": 3, "sliding_window": 8}, "auto"),
        # Cohere's layer norms and side-by-side blocks; Cohere 2's sliding layers beside a
        # global one that is not rotated
        ("cohere", {"num_layers": 2}, "auto"),
        # Arcee's ungated MLP: up's plain product, relu squared in the call
        ("arcee", {"num_layers": 2}, "auto"),
        # Nemotron's layer norms with their biases over Arcee's MLP, half of each head rotated
        ("nemotron", {"num_layers": 2}, "auto"),
        # StarCoder2: layer norms with biases, an ungated gelu MLP with biases, a window of 8
        ("starcoder2", {"num_layers": 2, "sliding_window": 8}, "auto"),
        # Phi-2: side by side on a layer norm with a bias, its MLP's and head's biases
        ("phi", {"num_layers": 2, "intermediate_size": 256}, "auto"),
        # Gemma 1: Gemma's norms and scaled embeddings in Llama's layer, its own head size
        ("gemma", {"num_layers": 2, "head_dim": 32}, "auto"),
        # StableLM: layer norms with a bias, a quarter of each head rotated, Q/K/V biases
        ("stablelm", {"num_layers": 2, "global_every": 0}, "auto"),
        # Apertus: an ungated MLP of xIELU, each layer's constants its own; Q/K norms
        ("apertus", {"num_layers": 2}, "auto"),
        # OLMo 1: weightless layer norms, Q/K/V clipped
        ("olmo", {"num_layers": 2}, "auto"),
        ("cohere2", {"num_layers": 4, "global_every": 4, "sliding_window": 8}, "auto"),
        # Q/K/V and O biases (Llama's attention_bias)
        ("llama", {"attention_bias": True}, "auto"),
        ("llama", {}, "bfloat16"),
        ("qwen3", {}, "float16"),
        ("qwen3", {}, "fp8_e5m2"),
        ("llama", {}, "fp8"),  # E4M3
    ],
)
def test_one_call_forward_is_bitwise_the_module_path(arch, extra, kv, model_dir):
    """Both engines get the same requests on a pool so tight that prompts are chunked and
    requests preempted (mixed prefill and decode steps, padding-free slot writes); after every
    step the logits are identical, and so are the tokens."""
    path = model_dir(arch, **extra)
    fused, modules = load_both(
        path,
        num_kv_blocks=48,
        block_size=4,
        max_num_batched_tokens=40,
        kv_cache_dtype=kv,
    )
    assert fused.core.runner.model.stack is not None
    assert modules.core.runner.model.stack is None
    # the LM head in the same call where it is untied (the tiny models tie Qwen's) and has no
    # bias (Phi-2's: after the call, through torch)
    spec = fused.core.runner.model.spec
    after = spec.tie_word_embeddings or spec.head_bias
    assert (fused.core.runner.model.stack.lm_head is None) == after
    for loaded in (fused, modules):
        for i, text in enumerate(PROMPTS):
            ids = loaded.tokenizer.encode(text)
            p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            loaded.core.add(EngineRequest(str(i), ids, p))
    steps = 0
    tokens = {True: {}, False: {}}
    while fused.core.has_work or modules.core.has_work:
        for is_fused, loaded in ((True, fused), (False, modules)):
            for out in loaded.core.step():
                tokens[is_fused].setdefault(out.request_id, []).extend(out.new_token_ids)
        a, b = fused.core.runner.last_logits, modules.core.runner.last_logits
        assert a is not None and torch.equal(a, b), f"step {steps}"
        steps += 1
    assert tokens[True] == tokens[False] and len(tokens[True]) == len(PROMPTS)
    assert steps > 20


def test_what_the_stack_refuses_is_said(model_dir, caplog):
    """oneDNN products leave the modules in charge, with a log line naming why; with
    --cpu-forward fused the server refuses to start instead."""
    import logging

    path = str(model_dir("llama"))
    with caplog.at_level(logging.INFO, logger="weir.cpu"):
        loaded = load(
            EngineConfig(model=path, dtype="float32", cpu_matmul="onednn", device="cpu")
        )
    assert loaded.core.runner.model.stack is None
    assert any("layer by layer: --cpu-matmul onednn" in m for m in caplog.messages)
    with pytest.raises(ValueError, match="cannot run as one call: an MLP bias"):
        load(
            EngineConfig(
                model=str(model_dir("llama", mlp_bias=True)), cpu_forward="fused", device="cpu"
            )
        )


def test_every_spec_field_is_stated():
    """A field added to ModelSpec (a decoder feature) must say how the compiled stack treats
    it: never a feature silently dropped on the fused path."""
    import dataclasses

    from gpu.cpu.forward import HANDLED
    from gpu.models.spec import ModelSpec

    assert set(HANDLED) == {f.name for f in dataclasses.fields(ModelSpec)}


def test_the_step_breakdown_counts_every_kind_of_op(model_dir):
    """gpu.cpu.forward.profile: seconds per op kind while on, zeroed as read, nothing when off."""
    from gpu.cpu import forward as cpu_forward

    loaded = load(EngineConfig(model=str(model_dir("llama")), dtype="float32", device="cpu"))
    loaded.core.add(EngineRequest("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4)))
    cpu_forward.profile(True)
    while loaded.core.has_work:
        loaded.core.step()
    spent = cpu_forward.profile(False)
    assert set(spent) == set(cpu_forward.PROFILE_OPS)
    assert all(spent[op] > 0 for op in ("qkv", "attention", "o", "gate/up", "down"))
    assert sum(cpu_forward.profile(False).values()) == 0.0


def test_a_token_or_position_outside_its_table_is_refused(model_dir):
    """The compiled call gathers embeddings and rotary rows itself: an id past the vocabulary
    raises IndexError, as torch.embedding does, never a read past the table."""
    from gpu.attention.backend import AttentionMetadata

    loaded = load(EngineConfig(model=str(model_dir("llama")), dtype="float32", device="cpu"))
    runner = loaded.core.runner
    model = runner.model
    meta = AttentionMetadata.build([-1], [[0]], [1], [1], lambda d, t: torch.tensor(d, dtype=t))
    embed = model.model.embed_tokens.weight
    cos, sin = model.rope.tables(1, torch.float32)
    ok, _ = model.stack(torch.tensor([3]), torch.tensor([0]), cos, sin, runner.kv_caches, meta)
    assert ok.shape == (1, embed.shape[1]) and torch.isfinite(ok).all()
    for ids, positions, error in (
        ([embed.shape[0]], [0], IndexError),
        ([-1], [0], IndexError),
        ([3], [cos.shape[0]], IndexError),
    ):
        with pytest.raises(error):
            model.stack(
                torch.tensor(ids), torch.tensor(positions), cos, sin, runner.kv_caches, meta
            )
    # the LM head's rows, in the same call: as compute_logits gives them; a row past the
    # step's tokens is refused
    args = (torch.tensor([3]), torch.tensor([0]), cos, sin, runner.kv_caches, meta)
    hidden, logits = model.stack(*args, logits_rows=torch.tensor([0]))
    assert torch.equal(hidden, ok) and torch.equal(logits, model.compute_logits(ok))
    with pytest.raises(IndexError, match="logits row"):
        model.stack(*args, logits_rows=torch.tensor([0, 1]))
