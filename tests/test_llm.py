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


def test_n_samples_and_truncate_prompt_tokens(model_dir):
    """vLLM's SamplingParams.n: n outputs of a prompt, indexed 0..n-1, each its own stream
    (seed, seed + 1, ...: the first equals the same request alone); truncate_prompt_tokens keeps
    the last (or, truncation_side "right", the first) tokens of the prompt."""
    import pytest

    from core.sampling import InvalidParam

    llm = LLM(str(model_dir("qwen3")), num_kv_blocks=128)
    ids = list(range(40, 70))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=3)
    (out,) = llm.generate([ids], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    samples = [c.token_ids for c in out.outputs]
    assert all(len(s) == 6 for s in samples) and len({tuple(s) for s in samples}) > 1
    for j in range(3):  # sample j is the stream of seed 7 + j
        alone = SamplingParams(temperature=1.0, seed=7 + j, max_tokens=6, ignore_eos=True)
        assert llm.generate([ids], alone, use_tqdm=False)[0].outputs[0].token_ids == samples[j]
    for side, kept in (("left", ids[-7:]), ("right", ids[:7])):
        p = SamplingParams(max_tokens=1, truncate_prompt_tokens=7, truncation_side=side)
        assert llm.generate([ids], p, use_tqdm=False)[0].prompt_token_ids == kept
    with pytest.raises(InvalidParam, match="n must be at least 1"):
        llm.generate([ids], SamplingParams(n=0), use_tqdm=False)
    with pytest.raises(InvalidParam, match="truncate_prompt_tokens"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=0), use_tqdm=False)


def test_chat_renders_as_the_server_and_generates_as_generate(model_dir):
    """vLLM's LLM.chat: a conversation (or several) through the chat template, as the server
    renders /v1/chat/completions (tool-call arguments as objects, content parts joined), the
    rendered text as each output's prompt; what cannot render is refused by field first."""
    import msgspec
    import pytest

    from core.sampling import InvalidParam
    from server.chat import render_text
    from server.requests import ChatMessage

    llm = LLM(str(model_dir("qwen3")), num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    first = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "river"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    second = [{"role": "user", "content": "the river"}]
    outs = llm.chat([first, second], params, use_tqdm=False)
    assert "hello\nriver" in outs[0].prompt
    for conversation, out in zip((first, second), outs):
        want = render_text(llm.tokenizer, None, msgspec.convert(conversation, list[ChatMessage]))
        assert out.prompt == want
        assert out.prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)
        alone = llm.generate([out.prompt_token_ids], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    one = llm.chat(second, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!")
    assert len(one) == 1 and one[0].prompt == "the river!"
    # the call's arguments reach the template as an object (its x), not as the JSON text
    calls = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.x }}"
    (args,) = llm.chat(
        first, params, use_tqdm=False, chat_template=calls + "{% endfor %}{% endfor %}"
    )
    assert args.prompt == "1"
    cont = llm.chat(
        [*second, {"role": "assistant", "content": "it"}],
        params,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert cont.prompt.rstrip().endswith("it")
    bad = [
        ([{"content": "no role"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{"}}]}],
            "messages[0].tool_calls",
        ),
    ]
    for conversation, field in bad:
        with pytest.raises(InvalidParam) as e:
            llm.chat([second, conversation], params, use_tqdm=False)
        assert e.value.param == field and "conversation 1" in str(e.value), e.value
    with pytest.raises(InvalidParam) as e:
        llm.chat(second, params, chat_template="no template here")
    assert e.value.param == "chat_template"
    with pytest.raises(InvalidParam) as e:
        llm.chat(second, params, chat_template_kwargs={"tools": []})
    assert e.value.param == "chat_template_kwargs"
    assert llm.engine.kv.num_free_blocks == 128  # nothing refused was admitted


def test_without_sampling_params_the_models_generation_config_applies(model_dir, tmp_path):
    """vLLM's get_default_sampling_params: generation_config.json's sampling fields (here greedy
    and 5 new tokens), which generate and chat use when given none; generation_config="vllm"
    reads none."""
    import json
    import shutil

    path = tmp_path / "model"
    shutil.copytree(model_dir("qwen3"), path)
    config = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 5, "repetition_penalty": 1.0}
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=64)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 5)
    out = llm.generate("the river", use_tqdm=False)[0]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    assert (
        out.outputs[0].token_ids
        == llm.generate("the river", greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    near = llm.generate([[7] * 61], use_tqdm=False)[0]  # 3 tokens of room: the default is cut
    assert len(near.outputs[0].token_ids) <= 3
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0]
    assert len(chat.outputs[0].token_ids) <= 5  # (16 without the model's defaults)
    plain = LLM(str(path), num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
