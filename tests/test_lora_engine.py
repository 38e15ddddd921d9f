"""LoRA in the engine beyond mixed generation: embedding requests that name adapters, and adapters
kept in host memory under --max-cpu-loras (least recently used dropped, read again when
needed)."""

from __future__ import annotations

import array

import pytest
import torch
import torch.nn.functional as F

from core.pooling import PoolingParams
from core.request import EngineRequest
from core.sampling import SamplingParams
from tests.lora_adapters import LORA_PROMPTS, engine, peft_greedy, peft_hidden, refs_of, run


def test_embeddings_with_adapters(lora_models):
    """Embedding requests for adapters and the base in one batch (mean and last-token pooling,
    the long prompts chunked): each vector is the pooled final hidden states of PEFT's model
    with that adapter."""
    base, adapters = lora_models("llama")
    loaded = engine(base, max_num_batched_tokens=48)
    core = loaded.core
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS[:2]]
    refs = refs_of(loaded, adapters)
    names = [None, "qv8", "all16"]
    kinds = {"mean": PoolingParams("mean"), "last": PoolingParams("last", normalize=False)}
    for n in names:
        for i, ids in enumerate(prompts):
            for kind, p in kinds.items():
                core.add(
                    EngineRequest(
                        f"{n}-{i}-{kind}", ids, SamplingParams(), pooling=p, lora=refs.get(n)
                    )
                )
    vectors = {}
    while core.has_work:
        for out in core.step():
            if out.finished:
                vectors[out.request_id] = torch.tensor(array.array("f", out.embedding).tolist())
    assert core.num_partial_prefills > 0
    for n in names:
        hidden = peft_hidden(base, adapters.get(n), prompts)
        for i, h in enumerate(hidden):
            want = {"mean": F.normalize(h.mean(0), dim=0), "last": h[-1]}
            for kind, v in want.items():
                torch.testing.assert_close(vectors[f"{n}-{i}-{kind}"], v, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(vectors["qv8-1-mean"], vectors["None-1-mean"], atol=1e-3)


def test_max_cpu_loras_keeps_the_most_recent_adapters(lora_models):
    """--max-loras 1 --max-cpu-loras 2, adapters asked for one after another: a third adapter
    drops the least recently used one from host memory, which is read again from its folder
    when it is next asked for; every request gets PEFT's tokens."""
    base, adapters = lora_models("llama")
    loaded = engine(base, max_loras=1, max_cpu_loras=2)
    core, slots = loaded.core, loaded.core.runner.lora
    refs = refs_of(loaded, adapters)
    ids = loaded.tokenizer.encode(LORA_PROMPTS[1])
    want = {}
    # (adapter, adapters read from their folders so far, adapters then in host memory)
    sequence = [
        ("qv8", 1, ["qv8"]),
        ("mlp4", 2, ["qv8", "mlp4"]),
        ("qv8", 2, ["mlp4", "qv8"]),  # in memory: not read again
        ("all16", 3, ["qv8", "all16"]),  # mlp4, the least recent, dropped
        ("mlp4", 4, ["all16", "mlp4"]),  # read again; qv8 dropped
    ]
    for step, (name, reads, held) in enumerate(sequence):
        got = run(core, [(f"{name}-{step}", ids, refs[name])], max_tokens=8)
        if name not in want:
            want[name] = peft_greedy(base, adapters[name], [ids], 8)[0]
        assert got[f"{name}-{step}"] == want[name], name
        assert slots.num_loads == reads
        assert list(slots.host) == [refs[n].key for n in held]
    assert slots.num_slot_loads == len(sequence)  # one slot: every change of adapter copies


def rounded(src, dst):
    """A copy of the adapter in `src` with A and B rounded to bfloat16 (kept float32)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "adapter_model.safetensors"))
    weights = {k: t.to(torch.bfloat16).float() for k, t in weights.items()}
    save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


def test_lora_dtype_bfloat16_holds_adapters_in_bfloat16(lora_models, tmp_path):
    """--lora-dtype bfloat16 on CPU: the slots are bfloat16 (half the bytes a step reads) and
    the mixed batch's tokens and log-probs are PEFT's for the adapters rounded to bfloat16
    (their scalings are powers of two: rounding commutes with them); float16 is refused on CPU,
    naming the flag."""
    from core.config import CheckpointError
    from tests.lora_adapters import TOP, assert_matches_peft

    base, adapters = lora_models("llama")
    loaded = engine(base, lora_dtype="bfloat16", max_num_batched_tokens=48, device="cpu")
    slots = loaded.core.runner.lora
    assert slots.layers[0]["gate_up"].a.dtype == torch.bfloat16
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS[:2]]
    names = [None, "all16", "mlp4"]
    want = {
        n: peft_greedy(
            base,
            None if n is None else rounded(adapters[n], tmp_path / n),
            prompts,
            8,
            logits=True,
        )
        for n in names
    }
    refs = refs_of(loaded, adapters)
    jobs = [(f"{n}-{i}", ids, refs.get(n)) for i, ids in enumerate(prompts) for n in names]
    got, logprobs = run(loaded.core, jobs, max_tokens=8, logprobs=TOP)
    assert_matches_peft(got, logprobs, want, names, len(prompts))
    with pytest.raises(CheckpointError, match="--lora-dtype float16"):
        engine(base, lora_dtype="float16", device="cpu")
