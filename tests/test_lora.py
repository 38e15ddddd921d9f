"""LoRA adapters (core/lora.py, gpu/lora.py): greedy tokens equal to transformers + PEFT's for
three adapters of different ranks and targets and the base model, mixed in one batch, with
chunked prefill and preemption; at most --max-loras adapters per step; prefix caching keyed by
adapter; adapters refused with a message naming them; the batched kernel against torch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from core.lora import LoraError, read_adapter
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.lora import LoraGroup, base_of, lora_add_reference
from tests.lora_adapters import (
    ADAPTERS,
    LORA_PROMPTS,
    MAX_TOKENS,
    TOP,
    assert_matches_peft,
    engine,
    peft_greedy,
    references,
    refs_of,
    run,
)
from tests.test_correctness import POOLS, PROMPTS


@pytest.mark.parametrize(
    "arch,pool,forward",
    [
        ("llama", "roomy", "auto"),
        ("llama", "tight", "auto"),
        ("qwen3", "tight", "auto"),
        ("qwen3", "roomy", "modules"),
        # Granite's residual factor is taken on O's and down's inputs: their adapters' too
        ("granite", "roomy", "auto"),
        # Cohere's blocks side by side, both adding to the stream; its Q/K rows reordered
        ("cohere", "roomy", "auto"),
        ("cohere", "roomy", "modules"),
    ],
)
def test_mixed_batch_matches_peft(arch, pool, forward, lora_models):
    """Every adapter and the base in one batch: each request's greedy tokens are PEFT's for
    its adapter, and so are its tokens' log-probs and top alternatives (to float32's
    rounding), through the compiled CPU stack and layer by layer (Granite: its factors' effect
    on the adapters, and on the log-probs: the logits divided)."""
    base, adapters = lora_models(arch)
    loaded = engine(base, cpu_forward=forward, **POOLS[pool])
    core = loaded.core
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS]
    want = references(arch, base, adapters, prompts, logits=True)
    refs = refs_of(loaded, adapters)
    jobs = [
        (f"{name}-{i}", ids, refs.get(name))
        for i, ids in enumerate(prompts)
        for name in [None, *ADAPTERS]
    ]
    got, logprobs = run(core, jobs, logprobs=TOP)
    assert_matches_peft(got, logprobs, want, [None, *ADAPTERS], len(prompts))
    tokens = {name: t for name, (t, _) in want.items()}
    assert tokens["qv8"] != tokens[None] and tokens["mlp4"] != tokens[None]  # they matter
    if pool == "tight":
        assert core.num_partial_prefills > 0, "expected chunked prefill"
        assert core.scheduler.num_preemptions > 0, "expected a preemption"
    assert core.runner.lora.num_loads == 3


def test_onednn_products_with_adapters(lora_models, monkeypatch):
    """--cpu-matmul onednn with --enable-lora: gate and up are two oneDNN products (the fused
    post-ops leave no place for the deltas before the activation), the others oneDNN's too;
    the mixed batch's tokens and log-probs are PEFT's."""
    from gpu.cpu import onednn

    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)  # these tiny weights packed as well
    base, adapters = lora_models("llama")
    loaded = engine(base, cpu_matmul="onednn", device="cpu")
    layer = loaded.core.runner.model.model.layers[0]
    kind, (gate, up), _ = layer.mlp.gate_up
    assert kind == "pair" and isinstance(gate, onednn.OneDnnWeight)
    assert isinstance(layer.mlp.down, onednn.OneDnnWeight)
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS]
    want = references("llama", base, adapters, prompts, logits=True)
    refs = refs_of(loaded, adapters)
    names = [None, *ADAPTERS]
    jobs = [(f"{n}-{i}", ids, refs.get(n)) for i, ids in enumerate(prompts) for n in names]
    got, logprobs = run(loaded.core, jobs, logprobs=TOP)
    assert_matches_peft(got, logprobs, want, names, len(prompts))


def record_logits(runner, monkeypatch) -> dict:
    """(request id, tokens it had) -> its sampled row's logits, for every step the runner runs."""
    seen = {}
    real = runner.submit

    def submit(out, *a, **kw):
        launched = real(out, *a, **kw)
        sampled = [s for s in out.scheduled if s.sample]
        for row, s in enumerate(sampled):
            seen[s.request_id, s.start + s.num_new_tokens] = runner.last_logits[row].clone()
        return launched

    monkeypatch.setattr(runner, "submit", submit)
    return seen


@pytest.mark.parametrize("forward", ["auto", "modules"])
def test_no_lora_work_without_an_adapter_in_the_step(forward, lora_models, monkeypatch):
    """With --enable-lora, a step with no adapter row hands the model no rows and calls no
    LoRA kernel (layer by layer: lora_add is never called; the compiled stack gets none); and
    base rows beside adapter rows get bitwise the logits they get with no adapter around."""
    base, adapters = lora_models("llama")
    loaded = engine(base, cpu_forward=forward)
    core, runner = loaded.core, loaded.core.runner
    calls, rows = [], []
    real_add = runner.model.backend.lora_add
    backend, model = runner.model.backend, runner.model
    monkeypatch.setattr(backend, "lora_add", lambda *a: calls.append(1) or real_add(*a))
    real_model = model.forward
    monkeypatch.setattr(model, "forward", lambda *a: rows.append(a[5]) or real_model(*a))
    alone = record_logits(runner, monkeypatch)
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS]
    run(core, [(f"b{i}", ids, None) for i, ids in enumerate(prompts)])
    assert calls == [] and rows and all(r is None for r in rows)

    loaded = engine(base, cpu_forward=forward)
    mixed = record_logits(loaded.core.runner, monkeypatch)
    ref = refs_of(loaded, adapters)["all16"]
    jobs = [(f"b{i}", ids, None) for i, ids in enumerate(prompts)]
    run(loaded.core, jobs + [(f"a{i}", ids, ref) for i, ids in enumerate(prompts)])
    base_keys = [k for k in mixed if k[0].startswith("b")]
    assert len(base_keys) == len(alone) == len(prompts) * MAX_TOKENS
    for key in base_keys:
        assert torch.equal(mixed[key], alone[key]), key


def test_at_most_max_loras_adapters_a_step(lora_models):
    """--max-loras 1: requests for a second adapter wait (counted, never failed) while the
    first's run; every request still gets PEFT's tokens."""
    base, adapters = lora_models("llama")
    loaded = engine(base, max_loras=1)
    core = loaded.core
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS[:2]]
    refs = refs_of(loaded, adapters)
    jobs = [(f"{n}-{i}", ids, refs[n]) for n in ("qv8", "mlp4") for i, ids in enumerate(prompts)]
    jobs += [(f"None-{i}", ids, None) for i, ids in enumerate(prompts)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, ids, r in jobs:
        core.add(EngineRequest(rid, ids, params, lora=r))
    got = {rid: [] for rid, _, _ in jobs}
    waited = 0
    while core.has_work:
        outs = core.step()
        stats = core.take_stats()
        waited = max(waited, core.scheduler.num_waiting_lora)
        assert len(core.scheduler.running_loras()) <= 1
        assert len(stats.lora_running) <= 1
        for out in outs:
            got[out.request_id] += out.new_token_ids
    assert waited == 2
    full = peft_greedy(base, None, prompts, MAX_TOKENS)
    assert [got[f"None-{i}"] for i in range(2)] == full
    for n in ("qv8", "mlp4"):
        assert [got[f"{n}-{i}"] for i in range(2)] == peft_greedy(
            base, adapters[n], prompts, MAX_TOKENS
        )


def test_prefix_cache_is_keyed_by_adapter(lora_models, tmp_path):
    """A prompt cached under one adapter is no hit for another adapter or the base; the same
    adapter hits; an adapter reloaded under its name with other weights misses."""
    base, adapters = lora_models("llama")
    loaded = engine(base)
    core = loaded.core
    refs = refs_of(loaded, adapters)
    ids = loaded.tokenizer.encode(PROMPTS[7])

    def hits(rid, ref):
        before = core.kv.num_hit_tokens
        run(core, [(rid, ids, ref)])
        return core.kv.num_hit_tokens - before

    assert hits("a", refs["qv8"]) == 0
    assert hits("b", refs["mlp4"]) == 0
    assert hits("c", None) == 0
    assert hits("d", refs["qv8"]) > 0
    assert hits("e", None) > 0
    # "qv8" again, from a folder with other weights: a new key, no hit
    other = tmp_path / "qv8"
    shutil.copytree(adapters["all16"], other)
    changed = read_adapter("qv8", other, base_of(core.runner.model.spec), 16).ref
    assert changed.name == "qv8" and changed.key != refs["qv8"].key
    assert hits("f", changed) == 0


def _copy(src, dst, **config):
    shutil.copytree(src, dst)
    data = json.loads((dst / "adapter_config.json").read_text())
    data.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(data))
    return dst


def test_adapters_refused_with_a_message_naming_them(lora_models, model_dir, tmp_path):
    base, adapters = lora_models("llama")
    shape = base_of(load_spec(base))
    src = adapters["all16"]
    cases = [
        (src, 8, "rank 16, more than --max-lora-rank 8"),
        (_copy(src, tmp_path / "m", modules_to_save=["lm_head"]), 16, "modules_to_save"),
        (_copy(src, tmp_path / "d", use_dora=True), 16, "DoRA"),
        (_copy(src, tmp_path / "b", bias="all"), 16, "bias"),
        (tmp_path / "missing", 16, "adapter_config.json"),
    ]
    added = _copy(src, tmp_path / "t")
    (added / "added_tokens.json").write_text("{}")
    cases.append((added, 16, "adds tokens"))
    # a copy cut short: its header promises bytes the file lacks (refused here, at load; it
    # had passed and then failed in the engine at the first request)
    cut = _copy(src, tmp_path / "c")
    weights = cut / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-200])
    cases.append((cut, 16, "runs past the end of the file"))
    for path, rank, message in cases:
        with pytest.raises(LoraError, match="'bad'") as e:
            read_adapter("bad", path, shape, rank)
        assert message in str(e.value)
    # an adapter made for another model's shapes
    other = base_of(load_spec(model_dir("llama", hidden_size=32, intermediate_size=64)))
    with pytest.raises(LoraError, match="does not fit the base model"):
        read_adapter("bad", src, other, 16)


def load_spec(path):
    from gpu.loader import load_config
    from gpu.models.spec import ModelSpec

    return ModelSpec.from_hf_config(load_config(path))


def random_group(slots, widths, rank, k, seed):
    g = torch.Generator().manual_seed(seed)
    cols = [0]
    for w in widths:
        cols.append(cols[-1] + w)
    a = torch.zeros(slots, len(widths), rank, k)
    b = torch.zeros(slots, rank, cols[-1])
    ranks = torch.randint(0, rank + 1, (slots, len(widths)), generator=g, dtype=torch.int32)
    for s in range(slots):
        for i, r in enumerate(ranks[s].tolist()):
            a[s, i, :r] = torch.randn(r, k, generator=g)
            b[s, :r, cols[i] : cols[i + 1]] = torch.randn(r, widths[i], generator=g)
    return LoraGroup(a, b, ranks, torch.tensor(cols), cols)


@pytest.mark.parametrize(
    "rows,widths,k,dtype",
    [
        (1, [24, 8, 8], 40, torch.float32),
        (5, [80, 16, 16], 70, torch.float32),  # whole column blocks and tails, k not a vector
        (37, [24, 8, 8], 40, torch.float32),  # several tiles of one adapter's rows
        (37, [130], 96, torch.bfloat16),  # --lora-dtype bfloat16: slots widened as read
    ],
)
def test_cpu_lora_kernel_matches_torch(rows, widths, k, dtype):
    """torch.ops.weir.lora_add_: each row with its slot's adapter or none (untouched), slices
    with their own ranks (0: skipped), y a strided view, against the torch reference."""
    from gpu.cpu import build as cpu_build

    g = random_group(3, widths, 16, k, seed=rows)
    g = g._replace(a=g.a.to(dtype), b=g.b.to(dtype))
    slots = torch.randint(-1, 3, (rows,), generator=torch.Generator().manual_seed(1))
    slots = slots.to(torch.int32)
    x = torch.randn(rows, k)
    n = sum(widths)
    big = torch.randn(rows, n + 10)
    before = big.clone()
    y = big[:, :n]
    want = lora_add_reference(y.clone(), x, g, slots)
    cpu_build.load().lora_add_(y, x, g.a, g.b, g.ranks, g.cols, slots)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    untouched = (slots < 0).nonzero().squeeze(1)
    assert torch.equal(big[untouched], before[untouched])
    assert torch.equal(big[:, n:], before[:, n:])
    bad = slots.clone()
    bad[0] = 3
    with pytest.raises(IndexError, match="slot 3 outside"):
        cpu_build.load().lora_add_(y, x, g.a, g.b, g.ranks, g.cols, bad)
    with pytest.raises(ValueError, match="lora ranks"):
        cpu_build.load().lora_add_(y, x, g.a, g.b, g.ranks + 17, g.cols, slots)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated_product_takes_a_pre_activation_addend(act):
    """The gated products' addend: act(x G^T + d_g) * (x U^T + d_u); a zero addend gives
    exactly the product without one (base rows beside adapter rows)."""
    from gpu.backend import ACTIVATIONS
    from gpu.cpu import gemm, quant
    from gpu.quant.quantize import quantize
    from gpu.quant.formats import FORMATS

    x, gate, up = torch.randn(7, 64), torch.randn(48, 64), torch.randn(48, 64)
    add = torch.randn(7, 96)
    add[2] = 0
    w = gemm.prepare_gated(gate, up, act)
    want = ACTIVATIONS[act](x @ gate.T + add[:, :48]) * (x @ up.T + add[:, 48:])
    got = gemm.gated(x, w, add)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[2], gemm.gated(x, w)[2])
    fmt = FORMATS["q8_0"]
    rows = [quantize(t.numpy(), "q8_0") for t in (gate, up)]
    qw = quant.pack(rows[0], fmt, (48, 64), up=rows[1], act=act)
    got = quant.linear(x, qw, add)
    assert torch.equal(got[2], quant.linear(x, qw)[2])
    g, u = (quant.linear(x, quant.pack(r, fmt, (48, 64))) for r in rows)
    want = ACTIVATIONS[act](g + add[:, :48]) * (u + add[:, 48:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_adapters_sharded_like_their_layers(lora_models):
    """TP=2: each rank holds its share of every adapter (B of Q/K/V and gate/up by rows, A of
    O and down by columns); the mixed batch's tokens and log-probs are still PEFT's."""
    base, adapters = lora_models("llama")
    loaded = engine(base, device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    core = loaded.core
    try:
        prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS]
        names = [None, "all16", "mlp4"]
        want = references("llama", base, adapters, prompts, logits=True)
        want = {n: (want[n][0][:3], want[n][1][:3]) for n in names}
        refs = refs_of(loaded, adapters)
        jobs = [(f"{n}-{i}", ids, refs.get(n)) for i, ids in enumerate(prompts[:3]) for n in names]
        got, logprobs = run(core, jobs, logprobs=TOP)
        assert_matches_peft(got, logprobs, want, names, 3)
    finally:
        core.close()


def test_an_adapter_unreadable_at_first_use_fails_its_request_not_the_engine(
    lora_models, monkeypatch
):
    """Reading the weights fails (an I/O error, a file the header check let through): that
    request is refused with a LoraError naming the adapter, and the engine goes on serving."""
    import safetensors.torch

    base, adapters = lora_models("llama")
    loaded = engine(base)
    core = loaded.core
    ref = refs_of(loaded, {"qv8": adapters["qv8"]})["qv8"]

    def unreadable(path, *args, **kw):
        raise OSError(f"{path}: Input/output error")

    monkeypatch.setattr(safetensors.torch, "load_file", unreadable)
    ids = loaded.tokenizer.encode(PROMPTS[0])
    with pytest.raises(LoraError, match="'qv8'.*Input/output error"):
        core.add(EngineRequest("a", ids, SamplingParams(max_tokens=2), lora=ref))
    monkeypatch.undo()
    assert len(run(core, [("b", ids, ref), ("c", ids, None)])["b"]) == MAX_TOKENS
