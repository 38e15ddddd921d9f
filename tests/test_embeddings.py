"""Embeddings from the engine: vectors equal to transformers' (AutoModel's last hidden state, the
same pooling and normalisation) for every pooling kind and model shape, batched, chunked (a
prompt longer than the step's token budget), served from the prefix cache, and mixed with
generation under preemption without changing the greedy tokens."""

from __future__ import annotations

import array

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from core.pooling import PoolingParams
from core.request import EngineRequest
from core.sampling import InvalidParam
from core.sampling import SamplingParams
from weir.llm import LLM

PROMPTS = [
    "the river runs to the sea",
    "a much longer prompt about valleys, canyons and the slow work of water on stone " * 4,
    "x",
]


def reference(model, ids: list[int], p: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[p.kind]
    if p.dimensions is not None:
        v = v[: p.dimensions]
    return F.normalize(v, dim=0) if p.normalize else v


def close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert F.cosine_similarity(got_t, want, dim=0).item() > 1 - 1e-4
    assert torch.allclose(got_t.norm(), want.norm(), rtol=1e-3)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, model_dir):
    path = str(model_dir(request.param))
    # A 48-token budget chunks the long prompt over several steps.
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=48, check_integrity=True)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return llm, hf


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_vectors_match_transformers(setup, kind):
    llm, hf = setup
    with pytest.raises(InvalidParam) as bad:  # (no matryoshka_dimensions in its config)
        llm.embed(PROMPTS, PoolingParams(kind, dimensions=16), use_tqdm=False)
    assert bad.value.param == "dimensions" and "Matryoshka" in str(bad.value)
    for p in (PoolingParams(kind), PoolingParams(kind, normalize=False)):
        outs = llm.embed(PROMPTS, p, use_tqdm=False)  # batched, the long one chunked
        assert len(outs[1].prompt_token_ids) > 48
        for out in outs:
            close(out.outputs.embedding, reference(hf, out.prompt_token_ids, p))
        again = llm.embed(PROMPTS[1], p, use_tqdm=False)[0]  # its blocks are cached now
        if kind == "last":
            assert again.num_cached_tokens >= 48
        else:  # mean and CLS pooling read every position: the cache is not used
            assert again.num_cached_tokens == 0
        close(again.outputs.embedding, reference(hf, again.prompt_token_ids, p))
    assert llm.engine.kv.num_free_blocks == 128  # nothing held once the vectors are out


def test_embeddings_beside_generation_under_preemption(model_dir):
    path = str(model_dir("qwen3"))
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    alone = LLM(path, num_kv_blocks=128).generate(["the river", "a canyon"], greedy, False)
    # 12 blocks of 16 tokens: two generations and the embeddings do not all fit at once.
    llm = LLM(path, num_kv_blocks=12, max_num_batched_tokens=64, check_integrity=True)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    core = llm.engine
    for i, text in enumerate(["the river", "a canyon"]):
        core.add(EngineRequest(f"g{i}", llm.tokenizer.encode(text), greedy))
    mean = PoolingParams("mean")
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    tokens: dict[str, list[int]] = {"g0": [], "g1": []}
    vectors: dict[str, list[float]] = {}

    def step() -> None:
        for out in core.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
            elif out.finished:
                assert out.new_token_ids == [] and out.num_output_tokens == 0
                vectors[out.request_id] = array.array("f", out.embedding).tolist()

    for _ in range(50):  # the generations hold most of the cache when the embeddings come
        step()
    for i, prompt in enumerate(ids):
        core.add(EngineRequest(f"e{i}", prompt, SamplingParams(), pooling=mean))
    while core.has_work:
        step()
    assert core.scheduler.num_preemptions > 0
    assert [tokens["g0"], tokens["g1"]] == [o.outputs[0].token_ids for o in alone]
    for i, prompt in enumerate(ids):
        close(vectors[f"e{i}"], reference(hf, prompt, mean))


def test_matryoshka_dimensions_offline(model_dir, tmp_path):
    """LLM.embed's `dimensions`: the first N of the vector, then normalized, where the model's
    config allows N; any other N refused by name, as the server refuses it."""
    import json
    import shutil

    shutil.copytree(model_dir("qwen3"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, config["hidden_size"]]
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), num_kv_blocks=64)
    hf = AutoModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    p = PoolingParams("mean", dimensions=16)
    for out in llm.embed(PROMPTS, p, use_tqdm=False):
        assert len(out.outputs.embedding) == 16
        close(out.outputs.embedding, reference(hf, out.prompt_token_ids, p))
    for bad in (20, 0):
        with pytest.raises(InvalidParam) as e:
            llm.embed(PROMPTS[0], PoolingParams("mean", dimensions=bad), use_tqdm=False)
        assert e.value.param == "dimensions"
