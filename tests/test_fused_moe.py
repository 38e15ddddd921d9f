"""The CUDA backend's mixture in two launches (gpu/cuda/kernels/fused_moe.py, gpu/cuda/moe.py),
in Triton's interpreter on CPU (compiled, on a GPU): the pairs laid out by expert on the device,
and the experts' outputs equal to each pair's own product, gated or gpt-oss's."""

from __future__ import annotations

import pytest
import torch

from core.config import EngineConfig
from gpu.cuda.kernels.fused_moe import BLOCK_M, align, moe_products
from gpu.cuda.moe import MoeStack, forward
from gpu.launch import load
from gpu.tiny_model import build_tiny_model
from tests.test_phi3 import use_cuda_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 4), (7, 2, 5), (40, 4, 8)])
def test_the_pairs_are_laid_out_by_expert_in_whole_blocks(tokens, k, experts):
    g = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if tokens > 1:
        chosen[chosen == 1] = 0  # an expert no token chose
    sorted_ids, blocks = align(chosen.to(DEVICE), experts)
    sorted_ids, blocks = sorted_ids.cpu(), blocks.cpu()
    pairs = tokens * k
    assert sorted_ids.numel() == blocks.numel() * BLOCK_M
    assert sorted_ids.numel() >= pairs + experts * (BLOCK_M - 1)  # the shape's bound
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = chosen.flatten()
    for b, e in enumerate(blocks.tolist()):
        rows = sorted_ids[b * BLOCK_M : (b + 1) * BLOCK_M]
        rows = rows[rows < pairs]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all() and (rows.diff() > 0).all()  # tokens in order
    used = blocks[blocks >= 0]
    assert (used.diff() >= 0).all() and set(used.tolist()) == set(flat.tolist())


def reference(x, w1, b1, w2, b2, weights, chosen, act):
    """Each (token, choice) pair's own products, weighted and summed (float64)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            h = x[t].double() @ w1[e].double().T + (0 if b1 is None else b1[e].double())
            h = act(h)
            y = h @ w2[e].double().T + (0 if b2 is None else b2[e].double())
            out[t] += float(weights[t, j]) * y
    return out


@pytest.mark.parametrize("kind", ["silu", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_the_experts_equal_each_pairs_own_products(kind, tokens):
    from gpu.models.gpt_oss import swiglu

    g = torch.Generator().manual_seed(tokens)
    e, hidden, inter, k = 4, 48, 40, 2  # widths that are not whole tiles
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(e, 2 * inter, hidden, generator=g) / 8
    w2 = torch.randn(e, hidden, inter, generator=g) / 8
    b1 = torch.randn(e, 2 * inter, generator=g) if kind == "gpt_oss" else None
    b2 = torch.randn(e, hidden, generator=g) if kind == "gpt_oss" else None
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    if kind == "gpt_oss":
        limits = (7.0, 1.702)

        def act(h):
            return swiglu(h[None].float(), *limits)[0].double()
    else:
        limits = None

        def act(h):
            gate, up = h.chunk(2)
            return torch.nn.functional.silu(gate) * up

    s = MoeStack(*(t if t is None else t.to(DEVICE) for t in (w1, b1, w2, b2)), "silu", limits)
    got = forward(x.to(DEVICE), weights.to(DEVICE), chosen.to(DEVICE), s).cpu()
    want = reference(x, w1, b1, w2, b2, weights, chosen, act)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "mxfp4"])
def test_4_bit_experts_equal_their_dequantized_products(fmt):
    """Experts in their 4-bit GPU form (Q4_0 / Q4_1 codes with a scale and min per 32, MXFP4's
    E2M1 codes), stacked, decoded tile by tile in the kernel: the products of the weights they
    hold (`Int4Weight.dequantize`), each expert's view of the stack holding its own."""
    from gpu.cuda.int4_weight import Int4Weight
    from gpu.cuda.moe import _stack_weights
    from tests.test_w4a16 import blocks

    g = torch.Generator().manual_seed(3)
    e, hidden, inter, k, tokens = 3, 96, 160, 2, 11  # 96, 160: a half k tile of 64 ends each
    forms = [
        [Int4Weight.from_blocks(blocks(fmt, n, kk, seed=10 * i + j), DEVICE) for i in range(e)]
        for j, (n, kk) in enumerate(((2 * inter, hidden), (hidden, inter)))
    ]
    (w1, views1), (w2, _) = _stack_weights(forms[0]), _stack_weights(forms[1])
    assert views1[1].qweight.data_ptr() == w1.qweight[1].data_ptr()
    dense = [torch.stack([f.dequantize().cpu() for f in fs]) for fs in forms]
    x = torch.randn(tokens, hidden, generator=g)
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    s = MoeStack(w1, None, w2, None, "silu", None)
    got = forward(x.to(DEVICE), weights.to(DEVICE), chosen.to(DEVICE), s).cpu()

    def act(h):
        gate, up = h.chunk(2)
        return torch.nn.functional.silu(gate) * up

    want = reference(x, dense[0], None, dense[1], None, weights, chosen, act)
    # float32 sums of large terms (unscaled 4-bit weights): within float32's reach of their size
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max(), rtol=1e-4)


def test_bad_shapes_are_refused():
    sorted_ids, blocks = align(torch.zeros(2, 1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="contiguous rows"):
        moe_products(torch.randn(2, 5), torch.randn(2, 3, 4), None, sorted_ids, blocks, 1, True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_mixture_on_the_cuda_backend_runs_stacked(arch, tmp_path, monkeypatch):
    """Every mixture layer's experts are stacked (one form: the experts' own weights are views
    of it)."""
    path = build_tiny_model(tmp_path / arch, arch, num_layers=2)
    config = use_cuda_backend(monkeypatch)
    core = load(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, **config)).core
    try:
        for layer in core.runner.model.model.layers:
            stacked = layer.mlp.stacked
            assert stacked is not None and stacked.num_experts == len(layer.mlp.experts)
            first = layer.mlp.experts[0]
            weight = first.gate_up[0] if arch == "gpt_oss" else first.gate_up[1][0]
            assert weight.data_ptr() == stacked.gate_up.data_ptr()
    finally:
        core.close()


def test_a_q4_0_mixture_runs_stacked_in_4_bits_with_the_portable_paths_logits(
    tmp_path, monkeypatch
):
    """A Q4_0 GGUF's experts stay 4-bit on the CUDA backend and are stacked (gate/up joined,
    each expert's weights views of the stack); the prompt's logits are the same file's on the
    per-expert path (the stack refused)."""
    from core.request import EngineRequest
    from core.sampling import SamplingParams
    from gpu.cuda import moe as cuda_moe
    from gpu.cuda.int4_weight import Int4Weight
    from gpu.quant.gguf_write import uniform, write_gguf

    hf = build_tiny_model(tmp_path / "hf", "qwen3_moe", num_layers=1)
    path = write_gguf(hf, tmp_path / "m-q4_0.gguf", uniform("q4_0"))
    config = use_cuda_backend(monkeypatch)

    def prompt_logits(check=None) -> torch.Tensor:
        core = load(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, **config))
        core = core.core
        try:
            if check is not None:
                check(core.runner.model.model.layers[0].mlp)
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            core.add(EngineRequest("r", list(range(5, 11)), params))
            while core.has_work:
                core.step()
            return core.runner.last_logits[0].float().cpu()
        finally:
            core.close()

    def stacked_in_4_bits(mlp) -> None:
        stacked = mlp.stacked
        assert isinstance(stacked.gate_up, Int4Weight) and stacked.gate_up.fmt == "q4_0"
        assert isinstance(stacked.down, Int4Weight)
        view = mlp.experts[1].down[0]
        assert view.qweight.data_ptr() == stacked.down.qweight[1].data_ptr()

    got = prompt_logits(stacked_in_4_bits)
    monkeypatch.setattr(cuda_moe, "stack", lambda moe: None)  # each expert its own product

    def per_expert(mlp) -> None:
        assert mlp.stacked is None and isinstance(mlp.experts[0].down[0], Int4Weight)

    want = prompt_logits(per_expert)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_stacked_mixture_replays_decode_graphs_with_the_eager_tokens(tmp_path, monkeypatch):
    """Stacked, a mixture reads nothing back to the host, so its decode steps are captured
    (`mixtures_on_device`); through the graphs' buffers and padding (the stand-in that replays
    by calling the forward again: padding rows are routed too, their output ignored) and the
    capture's check, two sequences decode the eager run's greedy tokens."""
    from core.request import EngineRequest
    from core.sampling import SamplingParams
    from gpu.models.moe import mixtures_on_device
    from tests.test_async_scheduling import drive
    from tests.test_cuda_graphs import with_graphs

    path = build_tiny_model(tmp_path / "m", "qwen3_moe", num_layers=1)
    config = use_cuda_backend(monkeypatch)
    runs = []
    for graphs in (False, True):
        config |= {"num_kv_blocks": 8, "max_model_len": 32}  # few KV splits to interpret
        loaded = load(EngineConfig(model=str(path), dtype="float32", **config))
        runner = loaded.core.runner
        assert mixtures_on_device(runner.model)
        if graphs:
            assert with_graphs(loaded, [2]).graphs  # the capture's check passed
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
        got, _ = drive(
            loaded.core, [EngineRequest(str(i), p, params) for i, p in enumerate(prompts)]
        )
        runs.append({k: v[0] for k, v in got.items()})
        if graphs:
            assert runner.graphs.num_replays >= 3
        loaded.core.close()
    assert runs[0] == runs[1]
