"""CUDA graphs' host side on CPU (gpu/cuda/graphs.py), through a stand-in that replays by calling
the forward again: the static buffers and padding of decode steps, the capture's check against
the eager forward, and the batch sizes captured."""

from __future__ import annotations

import pytest

from core.config import EngineConfig
from gpu.launch import load
from tests.test_correctness import POOLS, PROMPTS, reference, run_all


def with_graphs(loaded, sizes):
    """The runner's decode steps through gpu/cuda/graphs.py with the stand-in graph."""
    from gpu.cuda.graphs import DecodeGraphs, EagerGraph

    runner = loaded.core.runner
    graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        runner.device,
        runner.block_size,
        loaded.max_model_len,
        sizes,
        graph_factory=EagerGraph,
    )
    graphs.capture()
    runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("pool", POOLS)
def test_decode_graphs_pad_and_replay_without_changing_tokens(pool, model_dir):
    """The CUDA-graph path's buffers and padding, with a stand-in that replays by calling the
    forward again: decode-only steps that fit a captured size replay, padded up to it (ten
    sequences on 12 rows; with the tight pool, steps of up to 8 on 1/2/4/8 while larger ones and
    prefill steps run eagerly), and every token still matches transformers."""

    path = model_dir("qwen3")
    loaded = load(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="cpu",
            **POOLS[pool],
        )
    )
    graphs = with_graphs(loaded, [1, 2, 4, 8] if pool == "tight" else [1, 2, 4, 12])
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    got, _ = run_all(loaded.core, prompts)
    assert got == reference("qwen3", path, prompts)
    assert graphs.num_replays > 0


def test_graphs_that_replay_capture_time_values_are_refused(model_dir, caplog):
    """The capture's check: a graph whose replay gives what the capture computed (as one would
    that read a value back to the host while capturing) differs from the eager forward over new
    ids, so the graphs are dropped with a warning and the steps run eagerly."""
    from gpu.cuda.graphs import DecodeGraphs, EagerGraph

    class Frozen(EagerGraph):
        def replay(self):
            return self.output

    loaded = load(EngineConfig(model=str(model_dir("qwen3")), dtype="float32", device="cpu"))
    runner = loaded.core.runner
    where = (runner.model, runner.kv_caches, runner.device, runner.block_size, 64)
    good = DecodeGraphs(*where, [1, 2], graph_factory=EagerGraph)
    good.capture()
    bad = DecodeGraphs(*where, [1, 2], graph_factory=Frozen)
    with caplog.at_level("WARNING", logger="weir.cuda_graph"):
        bad.capture()
    assert sorted(good.graphs) == [1, 2] and not bad.graphs and not bad.can_run(good._meta(1))
    assert "decode graphs disabled" in caplog.text
    loaded.core.close()


def test_capture_sizes():
    from gpu.cuda.graphs import default_capture_sizes

    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 67
