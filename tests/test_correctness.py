"""Greedy tokens identical to transformers, logits within tolerance, for Llama, Qwen2 and Qwen3:
all prompts submitted together so they share steps, with a roomy pool and with one so small that
chunked prefill and preemption happen."""

from __future__ import annotations

import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load
from tests.conftest import ARCHS, transformers_greedy

PROMPTS = [
    "hello",
    "the model is a server",
    "café naïve résumé 你好 世界 😀 🎉",
    "One two three four five six seven eight nine ten eleven twelve",
    "token " * 40,
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
    "Привет мир данные γειά σου κόσμε and the river flow of water",
    "engine cache block batch request hello world weir river flow " * 6,
    "x",
    "where did the people go after they came back from the long day at work",
]
MAX_TOKENS = 24

POOLS = {
    # Plenty of blocks, a budget that fits everything at once.
    "roomy": dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=2048),
    # 4-token blocks, 64 of them (256 slots) for ten sequences that grow to ~110 tokens, and a
    # 48-token budget: long prompts are chunked and running requests get preempted.
    "tight": dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=48),
}

_reference: dict[str, list[list[int]]] = {}


def reference(arch: str, path, prompts: list[list[int]]) -> list[list[int]]:
    if arch not in _reference:
        _reference[arch] = transformers_greedy(path, prompts, MAX_TOKENS)
    return _reference[arch]


def run_all(core, prompts):
    for i, ids in enumerate(prompts):
        core.add(
            EngineRequest(
                str(i), ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            )
        )
    got = {str(i): [] for i in range(len(prompts))}
    steps = 0
    while core.has_work:
        for out in core.step():
            got[out.request_id] += out.new_token_ids
        core.kv.check_integrity()
        steps += 1
    return [got[str(i)] for i in range(len(prompts))], steps


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, pool, model_dir):
    path = model_dir(arch)
    loaded = load(
        EngineConfig(model=str(path), dtype="float32", check_integrity=True, **POOLS[pool])
    )
    core = loaded.core
    attention = core.runner.model.backend.attention.name
    assert attention == ("triton" if torch.cuda.is_available() else "cpu")
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) >= 8  # prompts of different lengths

    got, steps = run_all(core, prompts)
    assert got == reference(arch, path, prompts)
    # Batched: far fewer steps than running the requests one after another would take.
    assert steps < len(prompts) * MAX_TOKENS / 2
    if pool == "tight":
        assert core.num_partial_prefills > 0, "expected chunked prefill"
        assert core.scheduler.num_preemptions > 0, "expected a preemption"
    assert core.kv.num_free_blocks == core.kv.num_blocks


# (pool, token budget, request cap, prefix caching): chunked prompts with preemption, a budget
# smaller than most prompts, and everything at once with few slots.
ARRIVALS = [("tight", 48, 5, True), ("roomy", 16, 16, False), ("roomy", 2048, 3, True)]


@pytest.mark.parametrize("seed", range(len(ARRIVALS)))
def test_greedy_tokens_do_not_depend_on_arrival_order_or_budget(seed, model_dir):
    """The same greedy requests added in a random order at random steps, under other token
    budgets, request caps, pools and prefix caching on or off: each request's tokens are still
    transformers' (a served request never knows what it was batched with)."""
    import random

    rng = random.Random(seed)
    pool, budget, cap, caching = ARRIVALS[seed]
    path = model_dir("llama")
    loaded = load(
        EngineConfig(
            model=str(path),
            dtype="float32",
            check_integrity=True,
            max_num_seqs=cap,
            enable_prefix_caching=caching,
            **POOLS[pool] | {"max_num_batched_tokens": budget},
        )
    )
    core = loaded.core
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    want = reference("llama", path, prompts)
    # Two long prompts again: with prefix caching on, their second copies start from cached
    # blocks (or share them while the first copies still run).
    prompts, want = prompts + [prompts[4], prompts[7]], want + [want[4], want[7]]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    got: dict[str, list[int]] = {str(i): [] for i in order}
    while order or core.has_work:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if order:
                i = order.pop()
                p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
                core.add(EngineRequest(str(i), prompts[i], p))
        if core.has_work:
            for out in core.step():
                got[out.request_id] += out.new_token_ids
    assert [got[str(i)] for i in range(len(prompts))] == want
    if caching:
        assert core.kv.num_hit_tokens > 0, "expected prefix cache hits"
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, model_dir):
    from transformers import AutoModelForCausalLM

    path = model_dir(arch)
    # one forward a step, its logits read after it (asynchronous scheduling, the default on a
    # GPU, runs a step past the last token: its outputs are compared in test_async_scheduling)
    config = EngineConfig(
        model=str(path), dtype="float32", num_kv_blocks=64, async_scheduling=False
    )
    loaded = load(config)
    core = loaded.core
    ids = loaded.tokenizer.encode(PROMPTS[3])
    core.add(EngineRequest("r", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    ours, outputs = [], []
    while core.has_work:
        for out in core.step():
            outputs += out.new_token_ids
        ours.append(core.runner.last_logits[0].float().cpu())

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids + outputs[:-1]])).logits[0, len(ids) - 1 :]
    # First row: logits after the prefill; the rest after each decode step through the cache.
    torch.testing.assert_close(torch.stack(ours), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_match_transformers(arch, model_dir, monkeypatch):
    """Q/K/V and gate/up fused into one matrix product each, on torch's ops (the CUDA backend's
    layout, run here on the CPU)."""
    from gpu import assemble
    from gpu.attention.select import get_backend
    from gpu.backend import TorchBackend

    def torch_fused(config, device, dtype):
        return TorchBackend(get_backend("auto", device), fuse=True, name="torch, fused")

    monkeypatch.setattr(assemble, "choose_backend", torch_fused)
    path = model_dir(arch)
    loaded = load(EngineConfig(model=str(path), dtype="float32"))
    model = loaded.core.runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv is not None and not hasattr(attn, "q_proj")
    assert mlp.gate_up[0] == "fused" and not hasattr(mlp, "up_proj")
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    got, _ = run_all(loaded.core, prompts)
    assert got == reference(arch, path, prompts)


@pytest.mark.parametrize("arch,pool", [("qwen3", "tight"), ("llama", "roomy")])
def test_cuda_backend_matches_transformers(arch, pool, model_dir, monkeypatch):
    """The CUDA backend (gpu/cuda/backend.py: fused norms with their residual adds, the gated
    activation, Q/K norm and rotation with the K/V write, Triton attention), compiled on a GPU
    or, without one, in Triton's interpreter on CPU tensors (slow there: Qwen3's Q/K norms
    under chunked prefill and preemption, and Llama's plain rotation in one roomy batch)."""
    from gpu import assemble
    from gpu.attention.select import get_backend
    from gpu.cuda.backend import CudaBackend

    if not torch.cuda.is_available():
        monkeypatch.setattr(
            assemble, "choose_backend", lambda c, d, t: CudaBackend(get_backend("triton", d))
        )
    path = model_dir(arch)
    pool_config = POOLS[pool] | ({"num_kv_blocks": 40} if pool == "tight" else {})  # 5 rows
    loaded = load(EngineConfig(model=str(path), dtype="float32", **pool_config))
    assert isinstance(loaded.core.runner.model.backend, CudaBackend)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    # every other prompt is enough (the interpreter is slow): the tight pool still chunks the
    # long prompts and preempts (asserted below)
    want = reference(arch, path, prompts)[::2]
    prompts = prompts[::2]
    got, _ = run_all(loaded.core, prompts)
    assert got == want
    if pool == "tight":
        assert loaded.core.num_partial_prefills > 0 and loaded.core.scheduler.num_preemptions > 0


def assert_products_and_greedy(arch, path, loaded, layer) -> None:
    """A layer's down product equals the checkpoint's weight product; greedy == transformers."""
    backend = loaded.core.runner.model.backend
    x = torch.randn(5, loaded.core.runner.model.spec.intermediate_size)
    torch.testing.assert_close(
        backend.linear(x, layer.mlp.down), model_weight_product(path, x), atol=1e-4, rtol=1e-4
    )
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    got, _ = run_all(loaded.core, prompts)
    assert got == reference(arch, path, prompts)


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_linears_on_weirs_kernel_match_transformers(arch, model_dir):
    """The default CPU float32 path: Q/K/V fused at load, every product on weir's own packed
    kernel (gpu/cpu/gemm.py), the gated MLP in two products; transformers' greedy tokens."""
    from gpu.cpu.gemm import GemmGated, GemmWeight

    path = model_dir(arch)
    loaded = load(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    model = loaded.core.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv, GemmWeight)
    assert isinstance(layer.self_attn.o, GemmWeight)
    assert isinstance(layer.mlp.gate_up, GemmGated) and isinstance(layer.mlp.down, GemmWeight)
    if not model.spec.tie_word_embeddings:
        assert isinstance(model.lm_head.w, GemmWeight)
    assert_products_and_greedy(arch, path, loaded, layer)


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_linears_prepacked_match_transformers(arch, model_dir, monkeypatch):
    """oneDNN-prepacked products (--cpu-matmul onednn; weights big enough to gain, and these
    tiny models' are not: every one is packed here) still give transformers' greedy tokens and
    the checkpoint's products; too small ones stay on MKL."""
    from gpu.cpu import onednn

    path = model_dir(arch)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", cpu_matmul="onednn")
    layer = load(config).core.runner.model.model.layers[0]
    assert not isinstance(layer.mlp.down, onednn.OneDnnWeight)  # too small to gain
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)
    loaded = load(config)
    model = loaded.core.runner.model
    layer = model.model.layers[0]
    # Q/K/V are one product on CPU (fused at load), packed with O, gate, up and down.
    for w in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.down):
        assert isinstance(w, onednn.OneDnnWeight)
    assert isinstance(layer.mlp.gate_up, onednn.OneDnnGated)  # activation, multiply fused
    if not model.spec.tie_word_embeddings:  # llama's tiny model: an untied head, packed too
        assert isinstance(model.lm_head.w, onednn.OneDnnWeight)
    assert_products_and_greedy(arch, path, loaded, layer)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_gated_mlp_fuses_activation_multiply_and_residual(act, rows):
    """The oneDNN post-ops compute exactly the unfused down(act(gate(x)) * up(x)) + residual."""
    from torch import nn

    from gpu.backend import ACTIVATIONS
    from gpu.cpu import onednn

    torch.manual_seed(rows)
    gate, up, down = (
        nn.Linear(64, 96, bias=False),
        nn.Linear(64, 96, bias=False),
        nn.Linear(96, 64, bias=False),
    )
    pair = onednn.prepare_gated(gate.weight, up.weight, act)
    packed_down = onednn.prepare(down.weight, None)

    def mlp(x, residual=None):
        return onednn.linear(onednn.gated(x, pair), packed_down, residual)

    x, residual = torch.randn(rows, 64), torch.randn(rows, 64)
    with torch.no_grad():
        want = down(ACTIVATIONS[act](gate(x)) * up(x))
        torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mlp(x, residual), want + residual, atol=1e-5, rtol=1e-5)
        # A residual that is a view of a wider tensor (as a layer's input can be) is read right.
        wide = torch.randn(rows, 128)
        torch.testing.assert_close(mlp(x, wide[:, :64]), want + wide[:, :64], atol=1e-5, rtol=1e-5)


def model_weight_product(path, x):
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    return x @ weights["model.layers.0.mlp.down_proj.weight"].float().T


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_torch_attention(arch, model_dir):
    """The same check through the torch reference attention; the default backend on CPU is the
    compiled CPU kernel. The Triton attention kernels run in the CUDA backend's whole-model
    tests above (compiled on CUDA, interpreted on CPU), under this same tight pool on Qwen3:
    run again here beside torch's layers they had cost 14-16 s of interpreter for no path a
    server takes (on CUDA the layers are always the CUDA backend's)."""
    backend = "torch"
    path = model_dir(arch)
    loaded = load(
        EngineConfig(
            model=str(path),
            dtype="float32",
            check_integrity=True,
            attention_backend=backend,
            **POOLS["tight"],
        )
    )
    assert loaded.core.runner.model.backend.attention.name == backend
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    got, _ = run_all(loaded.core, prompts)
    assert got == reference(arch, path, prompts)
    assert loaded.core.num_partial_prefills > 0 and loaded.core.scheduler.num_preemptions > 0
