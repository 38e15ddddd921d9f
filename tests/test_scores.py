"""/classify, /score and /rerank: a sequence-classification checkpoint (transformers'
*ForSequenceClassification over weir's decoders) gives transformers' probabilities for every
input, batched, chunked and from the prefix cache; a one-label classifier (a cross-encoder
reranker) scores the tokenizer's pair encoding as transformers does and ranks documents by it;
an embedding model scores by the cosine of its vectors; each misuse is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from core.config import EngineConfig
from tests.conftest import LiveServer, tiny_config

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = [
    "the river runs to the sea",
    "a much longer text about valleys, canyons and the slow work of water on stone " * 4,
    "x",
]
QUERY = "where does the river go"
DOCS = ["the river runs to the sea", "a canyon is a deep valley", "x", "water on stone"]


def make_classifier(base, path, labels: dict[int, str], std: float = 1.0):
    """The tiny decoder at `base` under a random classifier head of len(labels) rows."""
    torch.manual_seed(len(labels))
    model = AutoModelForSequenceClassification.from_pretrained(
        base,
        num_labels=len(labels),
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        dtype=torch.float32,
    )
    with torch.no_grad():  # logits of a few units: probabilities far from uniform
        model.score.weight.normal_(0.0, std)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def classifier(request, model_dir, tmp_path_factory):
    """A three-label classifier, served (a 48-token budget chunks the long text), with
    transformers' model of the same weights; Llama's engine in its own process."""
    path = tmp_path_factory.mktemp("classifier") / "model"
    hf = make_classifier(model_dir(request.param), path, LABELS)
    config = EngineConfig(
        model=str(path),
        served_model_name=["clf"],
        max_model_len=512,
        num_kv_blocks=128,
        max_num_batched_tokens=48,
        check_integrity=True,
    )
    s = LiveServer(config, engine_process=request.param == "llama").start()
    yield s, hf
    s.stop()


@pytest.fixture(scope="module")
def reranker(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("reranker") / "model"
    hf = make_classifier(model_dir("qwen2"), path, {0: "LABEL_0"}, std=0.1)
    config = EngineConfig(model=str(path), max_model_len=128, num_kv_blocks=128)
    s = LiveServer(config).start()
    yield s, hf
    s.stop()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_classify_gives_transformers_probabilities(classifier):
    s, hf = classifier
    tok = s.state.tokenizer
    r = httpx.post(s.url + "/classify", json={"model": "clf", "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "clf" and body["id"].startswith("classify")
    lengths = [len(tok.encode(t)) for t in TEXTS]
    assert lengths[1] > 48  # chunked over several steps
    assert body["usage"] == {
        "prompt_tokens": sum(lengths),
        "total_tokens": sum(lengths),
        "completion_tokens": 0,
    }
    for i, (text, item) in enumerate(zip(TEXTS, body["data"])):
        want = hf_logits(hf, tok.encode(text)).softmax(-1)
        assert item["index"] == i and item["num_classes"] == 3
        assert torch.allclose(torch.tensor(item["probs"]), want, atol=1e-5), (item, want)
        assert item["label"] == LABELS[int(want.argmax())]
    # again, as token ids, from the prefix cache's blocks; and the raw logits
    hits = cache_hits(s)
    ids = tok.encode(TEXTS[1])
    r = httpx.post(s.url + "/classify", json={"input": ids, "use_activation": False}, timeout=60)
    (item,) = r.json()["data"]
    assert torch.allclose(torch.tensor(item["probs"]), hf_logits(hf, ids), atol=1e-4)
    assert cache_hits(s) >= hits + 48


def cache_hits(s) -> float:
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith("weir:prefix_cache_hits_total"):
            return float(line.split()[-1])
    raise AssertionError("no prefix_cache_hits_total")


def test_a_classifier_serves_nothing_else(classifier):
    s, _ = classifier
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
    ):
        r = httpx.post(s.url + path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model"
        assert "/classify" in r.json()["error"]["message"]
    # scoring needs one label
    r = httpx.post(s.url + "/score", json={"text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "3 labels" in r.json()["error"]["message"]
    # SageMaker's /invocations: an input is a classification here, not an embedding
    body = {"input": TEXTS[:2]}
    got, want = (
        httpx.post(s.url + p, json=body, timeout=60) for p in ("/invocations", "/classify")
    )
    assert got.status_code == 200 and got.json()["data"] == want.json()["data"], got.text


def test_scores_and_ranks_as_transformers_does(reranker):
    s, hf = reranker
    tok = s.state.tokenizer

    def want(a: str, b: str) -> float:
        return torch.sigmoid(hf_logits(hf, tok(text=a, text_pair=b)["input_ids"]))[0].item()

    r = httpx.post(s.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([want(QUERY, d) for d in DOCS], abs=1e-5)
    assert len(set(round(x, 4) for x in scores)) == len(DOCS)  # the order below means something
    # pairwise lists; a raw logit
    r = httpx.post(s.url + "/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}, timeout=60)
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [want(DOCS[0], DOCS[2]), want(DOCS[1], DOCS[3])], abs=1e-5
    )
    r = httpx.post(s.url + "/score", json={"text_1": "a", "text_2": "b", "use_activation": False})
    logit = hf_logits(hf, tok(text="a", text_pair="b")["input_ids"])[0].item()
    assert r.json()["data"][0]["score"] == pytest.approx(logit, abs=1e-4)
    # ranked, best first, on every path vLLM and Jina clients use
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(s.url + path, json={"query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == best[:3]
        assert [x["document"]["text"] for x in results] == [DOCS[i] for i in best[:3]]
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [scores[i] for i in best[:3]], abs=1e-5
        )
        pairs = sum(len(tok(text=QUERY, text_pair=d)["input_ids"]) for d in DOCS)
        assert r.json()["usage"] == {"total_tokens": pairs}


def test_bad_score_requests_name_their_field(reranker):
    s, _ = reranker
    long = "water " * 200  # past max_model_len (128)
    cases = [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/score", {"text_1": [], "text_2": "c"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": ["c", long]}, "text_2[1]"),
        ("/rerank", {"query": "a", "documents": ["c", long]}, "documents[1]"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["c"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "a", "documents": ["c"], "truncate_prompt_tokens": 0}, None),
        ("/rerank", {"query": "a", "documents": ["c"], "truncate_prompt_tokens": 500}, None),
        ("/rerank", {"query": 5, "documents": ["c"]}, "query"),
        ("/score", {"text_1": "a", "text_2": "b", "use_activation": True, "activation": False},
         "use_activation"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": [[5, 10**9]]}, "input"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = httpx.post(s.url + path, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert param is None or err["param"] == param, (body, err)
    # cut to the model's length instead, the longer text shortened
    body = {"query": "a", "documents": ["c", long], "truncate_prompt_tokens": -1}
    r = httpx.post(s.url + "/rerank", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 128 + len(s.state.tokenizer("a", "c")["input_ids"])


@pytest.fixture(scope="module")
def embedder(model_dir):
    config = tiny_config(model_dir, num_kv_blocks=256)
    s = LiveServer(config, enable_embeddings=True).start()
    yield s
    s.stop()


def test_an_embedding_model_scores_by_cosine(embedder, model_dir):
    s = embedder
    hf = AutoModel.from_pretrained(str(model_dir("qwen3")), dtype=torch.float32).eval()
    tok = s.state.tokenizer

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(hf(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1], dim=0)

    want = [float(vector(QUERY) @ vector(d)) for d in DOCS]
    r = httpx.post(s.url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in [QUERY, *DOCS])
    r = httpx.post(s.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert [x["index"] for x in r.json()["results"]] == sorted(range(4), key=lambda i: -want[i])
    # a cosine has no activation to turn off
    body = {"text_1": "a", "text_2": "b", "use_activation": False}
    r = httpx.post(s.url + "/score", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation"
    # not a classifier: /classify says so, naming the model
    r = httpx.post(s.url + "/classify", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_scoring_needs_a_reranker_or_embeddings(model_dir):
    s = LiveServer(tiny_config(model_dir)).start()
    try:
        r = httpx.post(s.url + "/rerank", json={"query": "a", "documents": ["b"]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model"
        assert "--enable-embeddings" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_a_classifier_with_embeddings_enabled_is_refused(reranker):
    s, _ = reranker
    config = EngineConfig(model=s.state.config.model, max_model_len=128, num_kv_blocks=64)
    bad = LiveServer(config, enable_embeddings=True)
    with pytest.raises(RuntimeError, match="cannot also serve embeddings"):
        bad.start()
    bad.stop()


@pytest.mark.parametrize(
    "arch", ["mistral", "phi3", "gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral"]
)
def test_every_decoders_classifier_gives_transformers_logits(arch, model_dir, tmp_path):
    """The engine alone (weir.llm.LLM) on each other decoder's classifier: its logits."""
    from core.pooling import CLASSIFY, PoolingParams
    from weir.llm import LLM

    hf = make_classifier(model_dir(arch), tmp_path, LABELS)
    llm = LLM(str(tmp_path), num_kv_blocks=64, max_model_len=256)
    if llm.engine.runner.model.spec.num_experts == 0:  # (float32 experts run as modules)
        assert llm.engine.runner.model.stack is not None  # the compiled CPU stack's states
    outs = llm.embed(TEXTS[:2], PoolingParams(CLASSIFY, False), use_tqdm=False)
    for out in outs:
        want = hf_logits(hf, out.prompt_token_ids)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-4), (out, want)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # a tied LM head, and one of its own
def test_a_causal_lm_reranks_by_its_tokens_under_hf_overrides(arch, model_dir):
    """Qwen3-Reranker's recipe (vLLM's --hf-overrides): the causal LM's P("yes") against "no" at
    the last token, as its sigmoid of the two rows' difference; without is_original_qwen3_reranker,
    a label a token (here "no" and "the": the tiny vocabulary has no "yes")."""
    from transformers import AutoModelForCausalLM

    path = model_dir(arch)
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.convert_tokens_to_ids(["no", "the"])
    overrides = {
        "architectures": [lm.config.architectures[0].replace("CausalLM", "SequenceClassification")],
        "classifier_from_token": ["no", "the"],
    }

    def last(text: str) -> torch.Tensor:
        with torch.no_grad():
            return lm(torch.tensor([text])).logits[0, -1, ids]

    for original in (True, False):
        config = EngineConfig(
            model=str(path),
            max_model_len=128,
            num_kv_blocks=64,
            hf_overrides={**overrides, "is_original_qwen3_reranker": original},
        )
        s = LiveServer(config).start()
        try:
            if original:
                r = httpx.post(s.url + "/rerank", json={"query": QUERY, "documents": DOCS})
                assert r.status_code == 200, r.text
                got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
                for i, d in enumerate(DOCS):
                    want = last(tok(text=QUERY, text_pair=d)["input_ids"]).softmax(-1)[1]
                    assert got[i] == pytest.approx(want.item(), abs=1e-5)
            else:
                r = httpx.post(s.url + "/classify", json={"input": TEXTS[0]})
                (item,) = r.json()["data"]
                want = last(tok.encode(TEXTS[0])).softmax(-1)
                assert item["probs"] == pytest.approx(want.tolist(), abs=1e-5)
                assert item["label"] == ["no", "the"][int(want.argmax())]
        finally:
            s.stop()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"classifier_from_token": ["no"]}, r"needs a \*ForSequenceClassification"),
        (
            {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["zq"]},
            "'zq' is no token",
        ),
        (
            {
                "architectures": ["Qwen3ForSequenceClassification"],
                "classifier_from_token": ["no"],
                "is_original_qwen3_reranker": True,
            },
            "needs two",
        ),
    ],
)
def test_bad_hf_overrides_stop_the_start(overrides, message, model_dir):
    from gpu.loader import load_config

    with pytest.raises(ValueError, match=message):
        load_config(model_dir("qwen3"), overrides)


def test_hf_overrides_must_be_a_json_object(capsys):
    from server.cli import main

    assert main(["serve", "--hf-overrides", "[1]"]) == 2
    assert "--hf-overrides must be a JSON object" in capsys.readouterr().err
    assert main(["serve", "--hf-overrides", "{nope"]) == 2
    assert "--hf-overrides: not JSON" in capsys.readouterr().err
