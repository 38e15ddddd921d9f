"""BERT-family encoders (BertModel, XLMRobertaModel and their sequence classifiers) served
offline: vectors, logits and pair scores equal to transformers' on the same weights, inputs of
different lengths in one step, BERT's token types for a pair's second text, RoBERTa's positions
past its padding id, bfloat16 weights; generation refused, and what an encoder is not served
with refused by name before it loads. The scheduler runs an encoder's input whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from core.config import CheckpointError, EngineConfig
from core.sampling import InvalidParam
from tests.encoder_models import build_encoder
from weir.llm import LLM

TEXTS = [
    "the river runs to the sea",
    "a much longer text about valleys, canyons and the slow work of water on stone " * 3,
    "x",
]
QUERY, DOCS = "where does the river go", ["the river runs to the sea", "hello world", "a canyon"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """encoders(family, labels=0, pooling="mean") -> a folder, each built once."""
    made = {}

    def get(family: str, labels: int = 0, pooling: str | None = "mean"):
        key = (family, labels, pooling)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-{labels}-{pooling}")
            made[key] = build_encoder(path, family, num_labels=labels, pooling=pooling)
        return made[key]

    return get


def hf_rows(path, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    kw = {} if types is None else {"token_type_ids": torch.tensor([types])}
    with torch.no_grad():
        return model(torch.tensor([ids]), **kw).last_hidden_state[0]


def pooled(rows: torch.Tensor, kind: str) -> torch.Tensor:
    return F.normalize(rows.mean(0) if kind == "mean" else rows[0], dim=0)


@pytest.mark.parametrize(
    "family,kind", [("bert", "mean"), ("xlm-roberta", "cls"), ("mpnet", "mean")]
)
def test_embeddings_equal_transformers(encoders, family, kind):
    """The folder's sentence-transformers pooling, three inputs of different lengths in one
    step (each attends to itself alone), equal to transformers' vectors."""
    path = encoders(family, pooling=kind)
    llm = LLM(str(path), max_model_len=128)
    assert llm.engine.scheduler.whole_prompts and not llm.engine.kv.enable_caching
    steps = llm.engine.num_steps
    out = llm.embed(TEXTS, use_tqdm=False)
    assert llm.engine.num_steps - steps == 1  # all three in one step
    tok = AutoTokenizer.from_pretrained(str(path))
    for text, o in zip(TEXTS, out):
        want = pooled(hf_rows(path, tok(text)["input_ids"]), kind)
        got = torch.tensor(o.outputs.embedding)
        assert (got - want).abs().max().item() < 1e-5


def test_cuda_backend_classifier_equals_transformers(encoders, monkeypatch):
    """The encoder on the CUDA backend (compiled on a GPU, else Triton's interpreter on CPU):
    transformers' logits."""
    from tests.test_phi3 import use_cuda_backend

    path = encoders("xlm-roberta", labels=3)
    llm = LLM(str(path), max_model_len=128, **use_cuda_backend(monkeypatch))
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    for text, o in zip(TEXTS, llm.classify(TEXTS, use_tqdm=False)):
        with torch.no_grad():
            want = hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
        assert (torch.tensor(o.outputs.probs) - want).abs().max().item() < 1e-4


def test_default_pooling_without_sentence_transformers_files_is_cls(encoders):
    """As vLLM's BERT and XLM-RoBERTa embedders: the [CLS] row, normalized."""
    path = encoders("bert", pooling=None)
    llm = LLM(str(path), max_model_len=128)
    ids = AutoTokenizer.from_pretrained(str(path))(TEXTS[0])["input_ids"]
    got = torch.tensor(llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding)
    assert (got - pooled(hf_rows(path, ids), "cls")).abs().max().item() < 1e-5


def test_roberta_positions_skip_its_padding_id(encoders):
    """A padding token inside an input keeps position pad_token_id and the later tokens
    count on without it, as transformers numbers them."""
    path = encoders("xlm-roberta", pooling="cls")
    llm = LLM(str(path), max_model_len=128)
    ids = [0, 17, 1, 23, 1, 1, 40, 2]  # 1: <pad>
    got = torch.tensor(llm.embed([ids], use_tqdm=False)[0].outputs.embedding)
    want = pooled(hf_rows(path, ids), "cls")
    assert (got - want).abs().max().item() < 1e-5
    plain = [0, 17, 5, 23, 5, 5, 40, 2]  # (the test means something: other positions differ)
    assert (pooled(hf_rows(path, plain), "cls") - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "mpnet"])
def test_classifier_logits_and_pair_scores_equal_transformers(encoders, family):
    """classify: each input's raw logits from its first token's row through the head (BERT's
    pooler and classifier, RoBERTa's dense and out_proj); score: a one-label classifier's
    sigmoid over the pair encoding, BERT's second text of token type 1."""
    path3, path1 = encoders(family, labels=3), encoders(family, labels=1)
    tok = AutoTokenizer.from_pretrained(str(path3))
    hf3 = AutoModelForSequenceClassification.from_pretrained(str(path3)).eval()
    llm = LLM(str(path3), max_model_len=128)
    out = llm.classify(TEXTS, use_tqdm=False)
    for text, o in zip(TEXTS, out):
        with torch.no_grad():
            want = hf3(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
        assert (torch.tensor(o.outputs.probs) - want).abs().max().item() < 1e-5
    del llm
    tok = AutoTokenizer.from_pretrained(str(path1))  # (each folder's tokenizer is its own)
    hf1 = AutoModelForSequenceClassification.from_pretrained(str(path1)).eval()
    llm = LLM(str(path1), max_model_len=128)
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    for doc, got in zip(DOCS, scores):
        enc = tok(QUERY, doc, return_tensors="pt", return_token_type_ids=True)
        with torch.no_grad():
            want = hf1(**enc).logits[0, 0].sigmoid().item()
            untyped = hf1(enc["input_ids"]).logits[0, 0].sigmoid().item()
        assert abs(got - want) < 1e-5
        if family == "bert":  # the token types change the score: the test can tell
            assert abs(untyped - want) > 1e-4


def test_bfloat16_weights(encoders):
    """--dtype bfloat16: the products on bfloat16 weights, close to float32's vectors."""
    path = encoders("bert")
    want = LLM(str(path), max_model_len=128).embed(TEXTS, use_tqdm=False)
    got = LLM(str(path), max_model_len=128, dtype="bfloat16").embed(TEXTS, use_tqdm=False)
    for w, g in zip(want, got):
        w, g = torch.tensor(w.outputs.embedding), torch.tensor(g.outputs.embedding)
        assert F.cosine_similarity(w, g, dim=0).item() > 0.999


def test_generation_and_long_inputs_refused(encoders):
    path = encoders("bert")
    llm = LLM(str(path), max_model_len=64)
    with pytest.raises(InvalidParam, match="encoder"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(InvalidParam, match="maximum context length"):
        llm.embed([[2] + [7] * 80 + [3]], use_tqdm=False)
    # truncate_prompt_tokens keeps the text's [CLS] and [SEP] around its first tokens (vLLM's
    # pooling default), or around its last
    from weir import PoolingParams

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok(TEXTS[1])["input_ids"]
    cut = llm.embed(TEXTS[1], use_tqdm=False, truncate_prompt_tokens=10)[0]
    assert cut.prompt_token_ids == ids[:9] + ids[-1:]
    left = PoolingParams(truncate_prompt_tokens=10, truncation_side="left")
    assert llm.embed(TEXTS[1], left, use_tqdm=False)[0].prompt_token_ids == ids[:1] + ids[-9:]


@pytest.mark.parametrize(
    "flags,named",
    [
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"enable_lora": True}, "--enable-lora"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "--speculative"),
    ],
)
def test_what_an_encoder_is_not_served_with_is_refused_by_name(encoders, flags, named):
    from gpu.launch import load

    with pytest.raises(CheckpointError, match=named):
        load(EngineConfig(model=str(encoders("bert")), **flags))


class WholeRunner:
    """A fake encoder runner: it records each step's (request, start, tokens) and pools each
    input it is given whole; a chunk fails the test."""

    vocab_size = 1000
    num_labels = 0
    pooling_only = True

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []

    def execute(self, out, grammar=None):
        from core.request import StepResult

        self.steps.append([(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled])
        lengths = {n.request_id: len(n.prompt_token_ids) for n in out.new}
        for s in out.scheduled:
            assert s.start == 0 and s.num_new_tokens == lengths[s.request_id]
        return StepResult([], [], pooled={s.request_id: b"\0" * 4 for s in out.scheduled})


def test_scheduler_runs_an_encoders_inputs_whole():
    """Under a budget of 16 tokens, inputs of 10, 10 and 16: the second waits for the next
    step instead of running its first 6 tokens beside the first; none is cached or chunked;
    an input the budget can never hold is refused by name, and so is generation."""
    from core.engine_core import EngineCore
    from core.pooling import PoolingParams
    from core.request import EngineRequest
    from core.sampling import SamplingParams

    runner = WholeRunner()
    core = EngineCore(
        runner, None, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
        max_model_len=64, check_integrity=True,
    )  # fmt: skip
    assert not core.kv.enable_caching

    def request(rid, n, pooling=PoolingParams("mean")):
        ids = [10 + i for i in range(n)]  # (the same prefix: a cache would have served it)
        return EngineRequest(rid, ids, SamplingParams(max_tokens=1), pooling=pooling)

    for rid, n in (("a", 10), ("b", 10), ("c", 16)):
        core.add(request(rid, n))
    done = set()
    while core.has_work:
        done |= {o.request_id for o in core.step() if o.finished and o.embedding is not None}
    assert done == {"a", "b", "c"}
    assert runner.steps == [[("a", 0, 10)], [("b", 0, 10)], [("c", 0, 16)]]
    with pytest.raises(InvalidParam, match="max-num-batched-tokens"):
        core.add(request("d", 17))
    with pytest.raises(InvalidParam, match="encoder"):
        core.add(request("e", 4, pooling=None))


def test_a_classifiers_own_activations(encoders, tmp_path):
    """As vLLM reads a config: a sentence-transformers CrossEncoder's activation_fn for its
    scores (ms-marco-MiniLM's Identity: the raw logit), problem_type for /classify
    (multi_label_classification: each label's sigmoid); an activation outside torch.nn's four
    is refused before the model is served."""
    import json
    import math
    import shutil

    from core.pooling import model_activations

    identity = "torch.nn.modules.linear.Identity"
    assert model_activations({"sbert_ce_default_activation_function": identity}) == (
        "default",
        "identity",
    )
    st = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}
    assert model_activations({**st, "problem_type": "regression"}) == ("identity", "sigmoid")
    path = tmp_path / "ce"
    shutil.copytree(encoders("bert", labels=1), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "sbert_ce_default_activation_function": identity})
    )
    llm = LLM(str(path), max_model_len=128)
    raw = llm.score(QUERY, DOCS, use_tqdm=False)
    default = LLM(str(encoders("bert", labels=1)), max_model_len=128)
    for r, d in zip(raw, default.score(QUERY, DOCS, use_tqdm=False)):
        assert 1 / (1 + math.exp(-r.outputs.score)) == pytest.approx(d.outputs.score, abs=1e-6)
    multi = tmp_path / "multi"
    shutil.copytree(encoders("bert", labels=3), multi)
    config = json.loads((multi / "config.json").read_text())
    config["problem_type"] = "multi_label_classification"
    (multi / "config.json").write_text(json.dumps(config))
    probs = LLM(str(multi), max_model_len=128).classify(TEXTS[0], use_tqdm=False)[0].outputs.probs
    assert abs(sum(probs) - 1) > 1e-3  # each label's own sigmoid, not a softmax
    config["sbert_ce_default_activation_function"] = "torch.nn.modules.activation.GELU"
    (multi / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GELU"):
        LLM(str(multi), max_model_len=128)


def test_sentence_transformers_max_seq_length_caps_the_context(encoders, tmp_path):
    """sentence_bert_config.json's max_seq_length (all-MiniLM-L6-v2's 256 of its 512
    positions) is the served context, as vLLM reads it: a longer input is refused by name,
    and a --max-model-len past it is refused at start."""
    import json
    import shutil

    path = tmp_path / "st"
    shutil.copytree(encoders("bert"), path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    llm = LLM(str(path))
    assert llm.max_model_len == 32
    with pytest.raises(InvalidParam, match="maximum context length is 32"):
        llm.embed([[2] + [7] * 31 + [3]], use_tqdm=False)
    assert len(llm.embed([[2] + [7] * 30 + [3]], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(CheckpointError, match="--max-model-len 64"):
        LLM(str(path), max_model_len=64)


def test_llm_encode_is_the_models_own_pooling(encoders):
    """vLLM's LLM.encode: an embedder's vectors (use_activation False: not normalized), a
    classifier's probabilities; a task the model has not, refused by name."""
    from weir import PoolingParams

    llm = LLM(str(encoders("bert")), max_model_len=128)
    vectors = [o.outputs.data for o in llm.encode(TEXTS, use_tqdm=False)]
    assert vectors == [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    raw = llm.encode(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert abs(torch.tensor(raw.outputs.data).norm().item() - 1) > 1e-3
    with pytest.raises(InvalidParam, match="pooling_task"):
        llm.encode(TEXTS, pooling_task="rank", use_tqdm=False)
    del llm
    clf = LLM(str(encoders("bert", labels=3)), max_model_len=128)
    probs = [o.outputs.data for o in clf.encode(TEXTS, use_tqdm=False)]
    assert probs == [o.outputs.probs for o in clf.classify(TEXTS, use_tqdm=False)]
