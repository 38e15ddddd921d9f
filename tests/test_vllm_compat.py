"""What a vLLM user expects of `weir serve` as a drop-in: custom roles, error messages, log-probs
shapes and limits, usage options, /tokenize keys, metric families and `vllm serve` flags."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from core.config import EngineConfig
from core.engine import Hold
from core.request import EngineRequest
from core.sampling import InvalidParam, SamplingParams
from core.stats import StepStats
from server.cli import build_parser, config_from_args, main, options_from_args
from server.stats_log import StatsLog
from tests.conftest import LiveServer, tiny_config, wait_for
from tests.test_scheduler import make_core

USER = [{"role": "user", "content": "Tell me about the river and the stone bridge"}]


@pytest.fixture(scope="module")
def server(model_dir):
    config = tiny_config(model_dir, num_kv_blocks=128, max_logprobs=30)
    s = LiveServer(config, metrics_prefix="vllm").start()
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


# ---------------------------------------------------------------- 1. custom roles
def test_custom_roles_reach_the_chat_template(server, client):
    messages = [
        {"role": "my-custom-role", "content": "context from a custom role"},
        {"role": "user", "content": "hi"},
    ]
    t = post(server, "/tokenize", {"messages": messages}).json()
    text = server.state.tokenizer.decode(t["tokens"])
    assert "<|im_start|>my-custom-role\ncontext from a custom role" in text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == t["count"]
    # Any last message may be continued, as vLLM and transformers allow (not only an assistant's)
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"


# ---------------------------------------------------------------- 2. logit_bias errors
def test_logit_bias_errors_name_the_vocabulary_size_and_every_bad_key(server):
    vocab = server.engine.core.runner.vocab_size
    r = post(server, "/v1/chat/completions", {"messages": USER, "logit_bias": {str(vocab): 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias"
    assert f"vocab_size={vocab}" in err["message"] and str(vocab) in err["message"]
    r = post(
        server,
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"abc": 1, "5": 2, "x1": 3, "1.5": 4}},
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias"
    for key in ("'abc'", "'x1'", "'1.5'"):
        assert key in err["message"], err["message"]
    assert "'5'" not in err["message"]


# ---------------------------------------------------------------- 3. logprobs 0
def test_completions_logprobs_zero_returns_the_sampled_token(server, client):
    for stream in (False, True):
        kw = dict(model="tiny", prompt="the river", max_tokens=5, temperature=0, logprobs=0)
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            tokens = [t for lp in lps for t in lp.tokens]
            values = [v for lp in lps for v in lp.token_logprobs]
            tops = [t for lp in lps for t in lp.top_logprobs]
        else:
            lp = client.completions.create(**kw).choices[0].logprobs
            tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
        assert len(tokens) == len(tops) == 5
        for token, value, top in zip(tokens, values, tops):
            assert top == {token: value}, (stream, top)
    # logprobs N: the sampled token first, then the N alternatives (N or N + 1 entries).
    lp = (
        client.completions.create(
            model="tiny", prompt="the river", max_tokens=5, temperature=0.8, seed=3, logprobs=3
        )
        .choices[0]
        .logprobs
    )
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == value and next(iter(top)) == token


def test_chat_top_logprobs_zero(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=4, logprobs=True, top_logprobs=0
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) <= 1 for e in content)


# ---------------------------------------------------------------- 4. continuous usage
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_needs_include_usage(server, route):
    body = {"max_tokens": 4, "stream": True, "ignore_eos": True}
    body |= {"messages": USER} if route == "chat" else {"prompt": "the river"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    for include, every in ((False, False), (True, True)):
        body["stream_options"] = {"include_usage": include, "continuous_usage_stats": True}
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events
        assert all((e["usage"] is not None) == every for e in events[:-1]), events
        assert (events[-1]["usage"] is not None) == include


# ---------------------------------------------------------------- 5. /tokenize
def test_tokenize_answers_with_vllms_keys(server):
    r = post(server, "/tokenize", {"prompt": "hi there"}).json()
    assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
    assert r["token_strs"] is None and r["count"] == len(r["tokens"])
    strs = post(server, "/tokenize", {"prompt": "hi there", "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    withtools = post(server, "/tokenize", {"messages": USER, "tools": tools})
    assert withtools.status_code == 200 and set(withtools.json()) == set(r)


# ---------------------------------------------------------------- 6. max logprobs, token ids
def test_max_logprobs_is_the_servers_limit(server, client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, logprobs=True, top_logprobs=25
    )
    assert all(len(e.top_logprobs) == 25 for e in r.choices[0].logprobs.content)
    for path, body, field in (
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 31}, None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 31}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 31}, "prompt_logprobs"),
    ):
        r = post(server, path, body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == (field or "top_logprobs"), err
        assert "30" in err["message"] and "--max-logprobs" in err["message"]


def test_engine_checks_max_logprobs_for_offline_use():
    core, _ = make_core()
    core.max_logprobs = 2
    with pytest.raises(InvalidParam) as e:
        core.add(EngineRequest("a", [1, 2, 3], SamplingParams(logprobs=3)))
    assert e.value.param == "logprobs"
    core.max_logprobs = -1  # up to the whole vocabulary
    core.add(EngineRequest("b", [1, 2, 3], SamplingParams(logprobs=500)))
    with pytest.raises(InvalidParam, match="vocab|1000"):
        core.add(EngineRequest("c", [1, 2, 3], SamplingParams(prompt_logprobs=1001)))


def test_return_tokens_as_token_ids(server, client, model_dir):
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for e in r.choices[0].logprobs.content:
        assert e.token.startswith("token_id:") and int(e.token.split(":")[1]) >= 0
        assert all(t.token.startswith("token_id:") for t in e.top_logprobs)
    ids = post(
        server,
        "/v1/completions",
        {
            "prompt": "the river",
            "max_tokens": 4,
            "logprobs": 1,
            "echo": True,
            "return_tokens_as_token_ids": True,
        },
    ).json()["choices"][0]["logprobs"]
    prompt_ids = post(server, "/tokenize", {"prompt": "the river"}).json()["tokens"]
    assert ids["tokens"][: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    assert all(k.startswith("token_id:") for top in ids["top_logprobs"][1:] for k in top)
    # The server-wide flag sets the default; a request's own false wins.
    s = LiveServer(
        EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=32),
        return_tokens_as_token_ids=True,
    ).start()
    try:
        body = {"prompt": "the river", "max_tokens": 2, "logprobs": 0}
        on = post(s, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
        off = post(s, "/v1/completions", body | {"return_tokens_as_token_ids": False}).json()
        assert all(t.startswith("token_id:") for t in on)
        assert not any(t.startswith("token_id:") for t in off["choices"][0]["logprobs"]["tokens"])
    finally:
        s.stop()


# ---------------------------------------------------------------- 7. metrics
def samples(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_negotiate_openmetrics_and_gzip(server):
    """As prometheus_client's handler (and vLLM's /metrics): OpenMetrics when the scraper asks
    for it, Prometheus text otherwise, gzipped when it takes gzip."""
    import gzip

    plain = httpx.get(server.url + "/metrics", headers={"Accept-Encoding": "identity"})
    assert plain.headers["content-type"].startswith("text/plain")
    assert "Content-Encoding" not in plain.headers
    accept = {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"}
    om = httpx.get(server.url + "/metrics", headers=accept)
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.headers["content-encoding"] == "gzip" and om.text.rstrip().endswith("# EOF")
    raw = httpx.Client().send(
        httpx.Request("GET", server.url + "/metrics", headers={"Accept-Encoding": "gzip"}),
        stream=True,
    )
    body = b"".join(raw.iter_raw())
    assert "vllm:num_requests_running" in gzip.decompress(body).decode()


def test_vllm_metric_families(server, client):
    before = samples(server)
    client.completions.create(
        model="tiny", prompt="the river", max_tokens=7, n=2, temperature=0.5, seed=1
    )
    after = samples(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    label = '{model_name="tiny"}'
    assert delta(f"vllm:request_params_n_sum{label}") == 2
    assert delta(f"vllm:request_params_n_count{label}") == 1
    assert delta(f"vllm:request_params_max_tokens_sum{label}") == 14  # both samples
    assert delta(f"vllm:request_inference_time_seconds_count{label}") == 2
    assert delta(f"vllm:request_inference_time_seconds_sum{label}") > 0
    assert delta(f"vllm:request_num_preemptions_count{label}") == 2
    assert after['vllm:request_num_preemptions_bucket{le="0.0",model_name="tiny"}'] >= 2
    for reason in ("capacity", "deferred"):
        assert f'vllm:num_requests_waiting_by_reason{{model_name="tiny",reason="{reason}"}}' in (
            after
        )
    assert after[f"vllm:admission_rejections_total{label}"] == 0
    info = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and after[info[0]] == 1
    for want in ('block_size="16"', 'num_gpu_blocks="128"', 'enable_prefix_caching="True"'):
        assert want in info[0], info[0]
    # vLLM 0.33's labels: tokens the cache holds (128 x 16), full-length requests that fit (/512)
    assert 'kv_cache_size_tokens="2048"' in info[0], info[0]
    assert 'kv_cache_max_concurrency="4.0"' in info[0], info[0]


def test_admission_rejections_are_counted(model_dir):
    """--max-waiting-requests 0: a request that finds a free seat is served (an idle server had
    refused everything); with the one seat taken, each further request is refused and counted."""
    s = LiveServer(
        EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=32, max_num_seqs=1),
        max_waiting_requests=0,
    ).start()
    try:
        assert post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert wait_for(lambda: s.engine.last_stats.num_running == 0)  # its seat is free again
        s.engine.hold(Hold(paused=True))
        first = {}
        t = threading.Thread(
            target=lambda: first.setdefault("r", post(s, "/v1/completions", {"prompt": "x"}))
        )
        t.start()
        assert wait_for(lambda: s.engine.num_waiting == 1)  # it has the seat, not yet stepped
        for _ in range(3):
            r = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["Retry-After"]
        s.engine.release()
        t.join(60)
        assert first["r"].status_code == 200
        counts = [
            v for k, v in samples(s).items() if k.startswith("weir:admission_rejections_total")
        ]
        assert counts == [3]
    finally:
        s.stop()


def test_deferred_waiting_requests_are_told_apart():
    """A further sample of a prompt waits on the first sample's prefill (deferred); a request
    that finds no room waits for capacity."""
    core, _ = make_core(budget=8, max_seqs=8)
    prompt = list(range(20, 60))
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    core.add(EngineRequest("lead", prompt, p))
    core.add(EngineRequest("follow", prompt, p, leader_id="lead"))
    core.add(EngineRequest("other", list(range(100, 140)), p))
    core.step()  # the leader's first chunk uses the whole budget
    stats = core.take_stats()
    assert (stats.num_waiting, stats.num_deferred) == (2, 1)
    while core.has_work:
        core.step()
    assert core.take_stats().num_deferred == 0


# ---------------------------------------------------------------- 8. vllm serve flags
def parse(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_vllm_flags_that_work():
    args = parse(
        "--model", "org/model", "--dtype", "half", "--max-model-len", "8k",
        "--max-logprobs", "-1", "--return-tokens-as-token-ids", "--disable-log-stats",
        "-tp", "1", "--trust-remote-code", "--swap-space", "4", "--kv-cache-dtype", "auto",
    )  # fmt: skip
    config, options = config_from_args(args), options_from_args(args)
    assert config.model == "org/model" and config.dtype == "float16"
    assert config.max_model_len == 8000 and config.max_logprobs == -1
    assert config.tensor_parallel_size == 1
    assert config_from_args(parse("-tp", "2")).tensor_parallel_size == 2
    assert options.return_tokens_as_token_ids and not options.log_stats
    assert parse("--max-model-len", "32K").max_model_len == 32768
    assert config_from_args(parse("--dtype", "float")).dtype == "float32"
    with pytest.raises(SystemExit):
        parse("--max-model-len", "lots")
    with pytest.raises(ValueError, match="--model"):
        config_from_args(parse("a/model", "--model", "b/model"))


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
        (["--tool-call-parser", "bogus"], "--tool-call-parser 'bogus'"),
        (["--reasoning-parser", "bogus"], "--reasoning-parser 'bogus'"),
        (["--quantization", "bitsandbytes"], "--quantization bitsandbytes"),
        (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype fp8_inc"),
        (["--tokenizer", "/no/such/tok"], "--tokenizer /no/such/tok"),
        (["--max-logprobs", "-5"], "--max-logprobs"),
    ],
)
def test_vllm_flags_weir_cannot_honour_fail_at_start(flags, named, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip()) > len(named) + 20, err


def test_vllm_flags_without_effect_are_logged():
    from server import vllm_flags

    notes = vllm_flags.check(parse("--trust-remote-code", "--swap-space", "4", "-tp", "2"))
    assert len(notes) == 2
    assert "no code from model repositories" in notes[0] and "recomputed" in notes[1]
    assert vllm_flags.check(parse()) == []


def test_stats_line():
    log = StatsLog()
    assert log.line(10.0) is None  # idle: nothing to say
    log.observe(StepStats(num_running=3, num_waiting=1, kv_usage=0.25, prompt_tokens=200,
                          generation_tokens=50, prefix_queries=100, prefix_hits=40))  # fmt: skip
    line = log.line(10.0)
    assert "Avg prompt throughput: 20.0 tokens/s" in line
    assert "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 1 reqs" in line and "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 40.0%" in line
    log.observe(StepStats())
    assert log.line(10.0) is None
    assert options_from_args(parse()).log_stats


def test_log_level_is_checked_as_a_flag(capsys):
    """--log-level takes the logging levels in either case; another value is argparse's one
    line and exit 2 (it had been a traceback from logging)."""
    args = build_parser().parse_args(["serve", "--log-level", "WARNING"])
    assert args.log_level == "warning"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--log-level", "bogus"])
    assert e.value.code == 2 and "--log-level" in capsys.readouterr().err
