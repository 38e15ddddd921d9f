"""The offline API: LLM(...).generate(...) on the same engine as the server."""

from __future__ import annotations

from weir import LLM, SamplingParams


def test_generate_matches_the_engine_and_keeps_order(model_dir):
    llm = LLM(str(model_dir("qwen3")), num_kv_blocks=128)
    prompts = ["hello", "the river flows over the stone", [11, 12, 13, 14]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello", "the river flows over the stone", None]
    assert outs[2].prompt_token_ids == [11, 12, 13, 14]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length" and o.finished
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    again = llm.generate("hello", params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert again.num_cached_tokens == 0  # "hello" is shorter than a block
    per = llm.generate(
        ["a", "b"],
        [
            SamplingParams(max_tokens=2, ignore_eos=True),
            SamplingParams(max_tokens=5, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in per] == [2, 5]
