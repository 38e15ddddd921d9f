"""Speculative decoding with a draft model (gpu/draft.py), and the CUDA graphs of speculation
(gpu/cuda/verify_graphs.py) through the stand-in that replays by calling the forward again."""

from __future__ import annotations

import json

import pytest
import torch

from core.config import EngineConfig
from gpu.launch import load
from tests.test_async_scheduling import drive, same
from tests.test_speculative import NGRAM, engine, oracle, workload


def draft_config(path, k: int = 3) -> str:
    return json.dumps(
        {
            "method": "draft_model",
            "model": str(path),
            "num_speculative_tokens": k,
            "disable_by_batch_size": 64,
        }
    )


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_a_draft_model_proposes_and_outputs_stay_the_same(model_dir, tmp_path, draft):
    """The model as its own draft proposes what it will say (nearly everything accepted, a
    fraction of the steps); another model (one layer, other weights) proposes little that is
    kept. Greedy outputs are the model's own either way, through chunked prefill, preemption,
    stops and log-probs; the draft's K/V shares the block pool (fewer blocks in the same
    memory)."""
    from gpu.tiny_model import build_tiny_model

    target = model_dir("qwen3")
    path = target if draft == "itself" else build_tiny_model(tmp_path / "d", "qwen3", seed=7,
                                                             num_layers=1)  # fmt: skip
    first, _ = drive(engine(model_dir, None, num_kv_blocks=32), workload())
    want, _ = drive(engine(model_dir, None, num_kv_blocks=32), workload(first))
    core = engine(model_dir, draft_config(path), num_kv_blocks=32)
    counts = {"drafted": 0, "accepted": 0, "steps": 0}
    take, step = core.take_stats, core.step

    def counting():
        s = take()
        counts["drafted"] += s.spec_draft_tokens
        counts["accepted"] += s.spec_accepted_tokens
        return s

    def stepping():
        counts["steps"] += 1
        out = step()
        counting()
        return out

    core.take_stats, core.step = counting, stepping
    got, _ = drive(core, workload(first))
    same(got, want)
    assert core.scheduler.num_preemptions > 0 and counts["drafted"] > 20
    if draft == "itself":
        assert counts["accepted"] >= 0.9 * counts["drafted"]
        assert counts["steps"] < 0.6 * sum(len(v[0]) for v in want.values())
    assert core.runner.draft.num_kept_first > 5  # first proposals made while catching up

    def sized(spec):
        config = EngineConfig(
            model=str(target), device="cpu", kv_cache_memory=1 << 20, speculative_config=spec
        )
        return load(config).core.kv.num_blocks

    assert sized(draft_config(path)) < sized(None)


def test_a_draft_model_must_share_the_tokenizer(model_dir, tmp_path):
    from core.config import CheckpointError
    from gpu.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "v", "qwen3", vocab_size=512)
    with pytest.raises(CheckpointError, match="same tokenizer"):
        engine(model_dir, draft_config(other))


@pytest.mark.parametrize(
    "method,backend", [("oracle", "cpu"), ("draft", "cpu"), ("oracle", "triton")]
)
def test_speculation_replays_cuda_graphs_with_the_same_tokens(
    model_dir, monkeypatch, method, backend
):
    """Verification steps replay graphs captured over k+1 query tokens a row (decodes, short
    runs and long ones padded into that layout), a draft model's proposals its own decode
    graphs and its catching up its own verification graphs: through the stand-in (a capture
    that records the forward and calls it again), the tokens are the same as without
    speculation, through chunked prefill (eager), stops, log-probs and n > 1, with the CPU
    kernel and with the Triton kernels (interpreted). With a GPU, the Triton leg runs there
    and replays the graphs the engine captured at start-up."""
    from gpu.cuda.graphs import DecodeGraphs, EagerGraph
    from gpu.cuda.verify_graphs import VerifyGraphs

    on_gpu = backend == "triton" and torch.cuda.is_available()
    device = {"device": "cuda", "dtype": "float32"} if on_gpu else {}
    first, _ = drive(engine(model_dir, None, **device), workload())
    want, _ = drive(engine(model_dir, None, **device), workload(first))
    if method == "oracle":
        oracle({k: v[0] for k, v in want.items()}, monkeypatch)
        spec, k = NGRAM, 4
    else:
        spec, k = draft_config(model_dir("qwen3")), 3
    core = engine(model_dir, spec, attention_backend=backend, **device)
    runner, sizes = core.runner, [1, 2, 4, 8]
    if not on_gpu:  # the stand-in, captured here as the engine would on a GPU
        where = (runner.model, runner.kv_caches, runner.device, runner.block_size)
        where += (core.max_model_len,)
        runner.graphs = DecodeGraphs(*where, sizes, graph_factory=EagerGraph)
        runner.verify_graphs = VerifyGraphs(*where, sizes, EagerGraph, query_len=k + 1)
        runner.graphs.capture()
        runner.verify_graphs.capture()
        if method == "draft":
            max_len = core.max_model_len
            runner.draft.capture_graphs(max_len, sizes, sizes, k, graph_factory=EagerGraph)
    got, _ = drive(core, workload(first))
    same(got, want)
    assert runner.verify_graphs.num_replays > 0
    if method == "draft":
        assert runner.draft.graphs.num_replays > 5
        assert runner.draft.verify_graphs.num_replays > 0
