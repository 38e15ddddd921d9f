"""Tensor parallelism on CPU with gloo: the engine drives one worker process per rank.

The sharded decoder must give transformers' greedy tokens, and the single-process engine's, for
every architecture (Qwen2's biases, Qwen3's Q/K norms and a head size other than hidden / heads,
fewer KV heads than ranks, a vocabulary that does not split evenly, a mixture of experts), under
chunked prefill and preemption; log-probs, grammars and embeddings cross the worker boundary too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from core.config import EngineConfig
from core.pooling import PoolingParams
from core.request import EngineRequest
from core.sampling import SamplingParams
from core.structured import Constraint
from gpu.dist import parallel
from gpu.launch import load
from gpu.models.spec import ModelSpec
from gpu.dist.node import WorkerDied, local_init_method
from tests.conftest import transformers_greedy

MAX_TOKENS = 12
PROMPTS = [
    "hello",
    "the river flows over stone and under the bridge",
    "token " * 30,
    "one two three four five six seven",
]


def generate(core, prompts: list[list[int]], **params) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
        core.add(EngineRequest(str(i), ids, p))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_work:
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    return got


def reference(path, prompts: list[list[int]]) -> dict[str, list[int]]:
    return {str(i): ids for i, ids in enumerate(transformers_greedy(path, prompts, MAX_TOKENS))}


# A chunked prefill (budget 16) and a KV pool small enough to preempt.
TIGHT = {"max_num_batched_tokens": 16, "num_kv_blocks": 12, "block_size": 4}
CASES = [
    # arch, world size, model shape, engine settings
    ("llama", 2, {}, {}),
    # Qwen2's Q/K/V biases, split with their rows
    ("qwen2", 2, {}, TIGHT),
    # Qwen3's Q/K norms and a head size other than hidden / heads; 2 KV heads on 4 ranks
    # (replicated, each rank keeping the one its query heads read)
    ("qwen3", 4, {"head_dim": 24}, TIGHT),
    # fewer KV heads than ranks, and a vocabulary that does not split evenly
    ("qwen3", 2, {"num_kv_heads": 1, "model_vocab_size": 1031}, TIGHT),
    # Gemma 3: each block's partial sums completed before its norm, sliding and global layers
    ("gemma3", 2, {"num_layers": 3}, {}),
    # a mixture of experts: every expert split as an MLP, the router replicated; Qwen2-MoE's
    # shared expert split so too, its gate replicated (the experts' split is the same as Qwen3's)
    ("qwen2_moe", 2, {"num_experts": 4}, TIGHT),
    # Phi-3: Q/K/V and gate/up one tensor each in the checkpoint, cut into parts, then each
    # part split as Llama's is; a window of 8
    ("phi3", 2, {"sliding_window": 8}, {}),
    # Granite: each rank's partial O and down products of its inputs times the residual factor
    ("granite", 2, {}, TIGHT),
    # GLM-4: Q/K heads reordered for its adjacent pairs, then split by head; norms after blocks
    ("glm4", 2, {"num_layers": 3}, {}),
    # Cohere: attention's and the MLP's partial sums in one all-reduce (rank 0's with the
    # residual); its layer norms over the whole hidden state, on every rank
    ("cohere", 2, {"num_layers": 2}, TIGHT),
    # Arcee: its ungated MLP's up split by columns as gate/up are, down by rows
    ("arcee", 2, {"num_layers": 2}, {}),
    # Nemotron: its layer norms' biases on every rank, half of each head rotated
    ("nemotron", 2, {"num_layers": 2}, TIGHT),
    # StarCoder2: its up and down biases split with their rows and added once, a window of 8
    ("starcoder2", 2, {"num_layers": 2, "sliding_window": 8}, {}),
    # StableLM side by side: one all-reduce a layer over its norms' biases, Q/K/V biases split
    ("stablelm", 2, {"num_layers": 2, "global_every": 1}, TIGHT),
    # Gemma 1: its head size (32, not hidden / heads) split by head, 1 + w norms
    ("gemma", 2, {"num_layers": 2, "head_dim": 32}, {}),
    # Apertus: each layer's xIELU parameters whole on every rank, Q/K norms per head
    ("apertus", 2, {"num_layers": 2}, {}),
    # OLMo 1: each rank's Q/K/V rows clipped, its weightless norms on every rank
    ("olmo", 2, {"num_layers": 2}, {}),
]


@pytest.mark.parametrize("arch,world,shape,engine", CASES)
def test_sharded_greedy_matches_transformers(model_dir, arch, world, shape, engine):
    from transformers import AutoTokenizer

    path = model_dir(arch, **shape)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    config = {"model": str(path), "dtype": "float32", "device": "cpu", **engine}
    single = load(EngineConfig(**config)).core
    want = reference(path, prompts)
    assert generate(single, prompts) == want
    core = load(EngineConfig(**config, tensor_parallel_size=world, check_integrity=True)).core
    try:
        assert len(core.runner.workers) == world
        assert generate(core, prompts) == want
        if "num_kv_blocks" in engine:
            assert core.scheduler.num_preemptions > 0  # the case exercised recomputation
        # a second round reuses the workers' mirrors (finished requests were forgotten)
        assert generate(core, prompts[:2]) == {k: want[k] for k in ("0", "1")}
    finally:
        core.close()
    assert all(w.proc.poll() == 0 for w in core.runner.workers)  # stopped, not killed


def test_logprobs_grammars_and_embeddings_cross_the_workers(model_dir):
    path = model_dir("qwen3")
    config = {"model": str(path), "dtype": "float32", "device": "cpu", "num_kv_blocks": 64}
    single = load(EngineConfig(**config)).core
    core = load(EngineConfig(**config, tensor_parallel_size=2)).core
    try:
        results = []
        for c in (single, core):
            lp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
            choice = Constraint("choice", json.dumps(["alpha river", "beta stone"]))
            picked = SamplingParams(temperature=0, max_tokens=20, structured=choice)
            c.add(EngineRequest("lp", [5, 6, 7, 8], lp))
            c.add(EngineRequest("choice", [9, 10, 11], picked))
            c.add(
                EngineRequest(
                    "vec", [12, 13, 14, 15, 16], SamplingParams(), pooling=PoolingParams("mean")
                )
            )
            c.add(EngineRequest("gone", [17, 18], SamplingParams(max_tokens=50, ignore_eos=True)))
            got: dict[str, list] = {"lp": [], "choice": [], "vec": [], "gone": []}
            steps = 0
            while c.has_work:
                for out in c.step():
                    got[out.request_id].append(out)
                steps += 1
                if steps == 3:
                    got["gone"].append(c.abort("gone"))
            results.append(got)
        one, two = results
        a = [x for o in one["lp"] for x in o.logprobs]
        b = [x for o in two["lp"] for x in o.logprobs]
        assert [x.token_id for x in a] == [x.token_id for x in b] and len(a) == 6
        assert [x.top_ids for x in a] == [x.top_ids for x in b]
        for x, y in zip(a, b):
            assert torch.allclose(
                torch.tensor(x.top_logprobs), torch.tensor(y.top_logprobs), atol=1e-4
            )
        text = "".join(o.new_text for o in two["choice"])
        assert text in ("alpha river", "beta stone") and two["choice"][-1].finish_reason == "stop"
        assert text == "".join(o.new_text for o in one["choice"])
        v1 = torch.frombuffer(bytearray(one["vec"][-1].embedding), dtype=torch.float32)
        v2 = torch.frombuffer(bytearray(two["vec"][-1].embedding), dtype=torch.float32)
        assert torch.allclose(v1, v2, atol=1e-5)
        assert two["gone"][-1].finish_reason == "abort"
    finally:
        core.close()


def second_node(path, init: str) -> subprocess.Popen:
    """`weir serve --headless --node-rank 1`: rank 1 on a "second machine" (this one)."""
    flags = ["--device", "cpu", "--dtype", "float32", "-tp", "2", "--nnodes", "2"]
    flags += ["--node-rank", "1", "--headless", "--distributed-init-method", init]
    return subprocess.Popen([sys.executable, "-m", "server", "serve", str(path), *flags])


def two_node_config(path, init: str) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        nnodes=2,
        distributed_init_method=init,
    )


def test_ranks_on_a_second_node_take_their_steps_from_rank_0(model_dir):
    from transformers import AutoTokenizer

    path = model_dir("qwen3")
    prompts = [AutoTokenizer.from_pretrained(path).encode(p) for p in PROMPTS]
    init = local_init_method()
    node1 = second_node(path, init)
    try:
        core = load(two_node_config(path, init)).core
        try:
            assert [w.rank for w in core.runner.workers] == [0]  # rank 1 is node 1's
            assert generate(core, prompts) == reference(path, prompts)
        finally:
            core.close()
        assert node1.wait(30) == 0  # rank 0 relayed the Stop; node 1 left cleanly
    finally:
        if node1.poll() is None:
            node1.kill()


def test_a_dead_rank_on_another_node_fails_the_next_step(model_dir):
    path = model_dir("qwen3")
    init = local_init_method()
    node1 = second_node(path, init)
    try:
        core = load(two_node_config(path, init)).core
        try:
            assert generate(core, [[5, 6, 7]]) == generate(core, [[5, 6, 7]])  # served
            (worker,) = [
                int(pid)
                for pid in os.listdir("/proc")
                if pid.isdigit() and _parent(int(pid)) == node1.pid
            ]
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(WorkerDied, match="rank 0: .*(closed|reset|peer)"):
                generate(core, [[5, 6, 7]])
        finally:
            core.close()
        assert node1.wait(30) == 1  # its rank died: the node says so
    finally:
        if node1.poll() is None:
            node1.kill()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def test_a_rank_that_fails_to_load_fails_the_start_with_its_reason(model_dir):
    config = EngineConfig(
        model=str(model_dir("qwen3")), device="cpu", tensor_parallel_size=2, kv_cache_memory=10
    )
    with pytest.raises(WorkerDied, match="rank .: ValueError: no room for the KV cache"):
        load(config)
    workers = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and _parent(int(pid)) == os.getpid() and _is_worker(pid)
    ]
    assert not workers  # none left behind


def _is_worker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"gpu.dist.worker" in f.read()
    except OSError:
        return False


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(model_dir):
    config = EngineConfig(model=str(model_dir("llama")), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide"):
        load(config)


def _spec(**kw) -> ModelSpec:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=1000,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=False,
        mlp_bias=False,
        qk_norm=False,
        hidden_act="silu",
        max_position_embeddings=128,
    )
    return ModelSpec(**{**base, **kw})


def test_shards_cover_the_checkpoint_once():
    """Column shards tile the rows, row shards the columns, vocabulary shards the rows (padded
    at the end); replicated KV heads are the ones each rank's query heads read."""
    spec = _spec()
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(16, 64),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96),
        "model.layers.0.mlp.down_proj.bias": torch.randn(64),
        "lm_head.weight": torch.randn(1000, 64),
        "model.norm.weight": torch.randn(64),
    }
    for world in (2, 4):
        parts = {
            name: [shard(name, t, spec, world, r) for r in range(world)] for name, t in full.items()
        }
        cat0 = lambda name: torch.cat(parts[name])  # noqa: E731
        for name in ("q_proj", "up_proj"):
            key = next(k for k in full if name in k)
            assert torch.equal(cat0(key), full[key])
        for name in ("o_proj", "down_proj.weight"):
            key = next(k for k in full if name in k)
            assert torch.equal(torch.cat(parts[key], dim=1), full[key])
        bias = parts["model.layers.0.mlp.down_proj.bias"]
        assert torch.equal(sum(bias), full["model.layers.0.mlp.down_proj.bias"])  # added once
        head = cat0("lm_head.weight")
        assert head.shape[0] == -(-1000 // world) * world
        assert torch.equal(head[:1000], full["lm_head.weight"]) and not head[1000:].any()
        assert all(torch.equal(p, full["model.norm.weight"]) for p in parts["model.norm.weight"])
        k = parts["model.layers.0.self_attn.k_proj.weight"]
        if world == 2:  # one KV head each
            assert torch.equal(torch.cat(k), full["model.layers.0.self_attn.k_proj.weight"])
        else:  # 2 KV heads on 4 ranks: ranks 0-1 read head 0, ranks 2-3 head 1
            heads = full["model.layers.0.self_attn.k_proj.weight"].view(2, 8, 64)
            assert [torch.equal(p, heads[r // 2]) for r, p in enumerate(k)] == [True] * 4


def shard(name, tensor, spec, world, rank):
    return parallel.shard(name, tensor, spec, parallel.TensorParallel(rank, world))


@pytest.mark.parametrize(
    "kw,world,problem",
    [
        ({"num_heads": 6, "head_dim": 8}, 4, "6 attention heads"),
        ({"num_kv_heads": 3, "num_heads": 12}, 4, "3 KV heads"),
        ({"intermediate_size": 90}, 4, "MLP of 90"),
    ],
)
def test_shapes_that_do_not_split_are_refused(kw, world, problem):
    with pytest.raises(ValueError, match=problem):
        parallel.check(_spec(**kw), world)
