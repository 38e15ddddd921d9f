"""LoRA on the CUDA backend without a GPU: the Triton shrink/expand kernels
(gpu/cuda/kernels/lora.py, in Triton's interpreter on CPU) against the torch reference, and
decode steps with adapters replayed through the CUDA-graph path's static buffers
(gpu/cuda/graphs.py, with its stand-in graph) giving PEFT's tokens and log-probs."""

from __future__ import annotations

import pytest
import torch

from gpu.cuda.kernels.lora import lora_shrink_expand
from gpu.lora import LoraBatch, LoraGroup, lora_add_reference
from tests.lora_adapters import (
    ADAPTERS,
    LORA_PROMPTS,
    TOP,
    assert_matches_peft,
    engine,
    peft_greedy,
    references,
    refs_of,
    run,
)
from tests.test_correctness import POOLS
from tests.test_cuda_graphs import with_graphs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_group(slots, widths, max_rank, k, seed, dtype=torch.float32):
    """Slots as gpu/lora.py fills them: each slice its own rank (0 some), zeros past it."""
    g = torch.Generator().manual_seed(seed)
    cols = [0]
    for w in widths:
        cols.append(cols[-1] + w)
    a = torch.zeros(slots, len(widths), max_rank, k)
    b = torch.zeros(slots, max_rank, cols[-1])
    ranks = torch.randint(0, max_rank + 1, (slots, len(widths)), generator=g, dtype=torch.int32)
    ranks[0, 0] = max_rank
    for s in range(slots):
        for i, r in enumerate(ranks[s].tolist()):
            a[s, i, :r] = torch.randn(r, k, generator=g)
            b[s, :r, cols[i] : cols[i + 1]] = torch.randn(r, widths[i], generator=g)
    d = dict(device=DEVICE)
    return LoraGroup(
        a.to(dtype=dtype, **d),
        b.to(dtype=dtype, **d),
        ranks.to(**d),
        torch.tensor(cols, **d),
        cols,
    )


def batch_of(slots: list[int], num_slots: int) -> LoraBatch:
    return LoraBatch.build(slots, num_slots, lambda v, dt: torch.tensor(v, dtype=dt, device=DEVICE))


@pytest.mark.parametrize(
    "rows,widths,max_rank,k,dtype,split_k",
    [
        (1, [48, 16, 16], 16, 96, torch.float32, 1),  # Q/K/V-like, one decode row
        (7, [48, 16, 16], 16, 96, torch.float32, 3),  # k split in three (the last share short)
        (37, [80, 80], 8, 40, torch.float32, 1),  # gate/up-like: slot runs over two row tiles
        (19, [72], 32, 130, torch.bfloat16, 2),  # one slice, a rank past 16, k not a tile
        (9, [48, 16, 16], 16, 96, (torch.float32, torch.bfloat16), 1),  # --lora-dtype bfloat16
    ],
)
def test_triton_lora_kernel_matches_torch(rows, widths, max_rank, k, dtype, split_k):
    """Each row with its slot's adapter or none: rows without one keep their values bit for
    bit, slices of rank 0 add nothing, y is a view into a wider tensor; the rest equals the
    torch reference (float32: to float32's rounding; bfloat16: to its own). A pair of dtypes:
    the activations', then the slots'."""
    dtype, slots_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    g = random_group(3, widths, max_rank, k, seed=rows, dtype=slots_dtype)
    gen = torch.Generator().manual_seed(rows)
    slots = torch.randint(-1, 3, (rows,), generator=gen).tolist()
    if rows > 30:
        slots[:20] = [1] * 20  # a run longer than one tile of rows
    batch = batch_of(slots, 3)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    n = sum(widths)
    wide = torch.randn(rows, n + 5, generator=gen).to(DEVICE, dtype)
    y = wide[:, :n]
    want = lora_add_reference(y.clone(), x, g, batch.rows)
    before = wide.clone()
    lora_shrink_expand(
        y,
        x,
        g.a,
        g.b,
        g.ranks,
        g.cols,
        g.cols_list,
        batch.order,
        batch.counts,
        batch.starts,
        split_k=split_k,
    )
    none = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(wide[none], before[none])
    assert torch.equal(wide[:, n:], before[:, n:])
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)
    else:  # the delta rounded where the reference rounds it, then once more in the sum
        scale = (want.float() - before[:, :n].float()).abs().max().item()
        torch.testing.assert_close(y.float(), want.float(), rtol=0, atol=scale / 64)


def test_triton_lora_kernel_checks_its_arguments():
    g = random_group(2, [32], 16, 32, seed=0)
    batch = batch_of([0, 1], 2)
    x, y = torch.randn(2, 32, device=DEVICE), torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="order must be"):
        lora_shrink_expand(
            y,
            x,
            g.a,
            g.b,
            g.ranks,
            g.cols,
            g.cols_list,
            batch.order[:1],
            batch.counts,
            batch.starts,
        )
    with pytest.raises(ValueError, match="share one dtype"):
        lora_shrink_expand(
            y,
            x.double(),
            g.a,
            g.b,
            g.ranks,
            g.cols,
            g.cols_list,
            batch.order,
            batch.counts,
            batch.starts,
        )


def test_decode_steps_with_adapters_replay_graphs(lora_models):
    """With --enable-lora the graphs are captured with and without adapters: decode steps with
    adapters replay over the static LoRA buffers (padding rows with none), steps without run
    no LoRA work, and under chunked prefill and preemption every request still gets PEFT's
    tokens and log-probs."""
    base, adapters = lora_models("llama")
    loaded = engine(base, **POOLS["tight"])
    graphs = with_graphs(loaded, [1, 2, 4, 8, 12, 16])
    assert set(graphs.lora_graphs) == set(graphs.graphs)
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS]
    want = references("llama", base, adapters, prompts, logits=True)
    refs = refs_of(loaded, adapters)
    names = [None, *ADAPTERS]
    jobs = [(f"{n}-{i}", ids, refs.get(n)) for i, ids in enumerate(prompts) for n in names]
    got, logprobs = run(loaded.core, jobs, logprobs=TOP)
    assert_matches_peft(got, logprobs, want, names, len(prompts))
    assert graphs.num_lora_replays > 0
    assert loaded.core.scheduler.num_preemptions > 0


def test_cuda_backend_with_adapters_matches_peft(lora_models, monkeypatch):
    """The CUDA backend (Triton's interpreter without a GPU) with adapters: its shrink/expand
    kernels, eagerly for the prompts and inside the decode graphs, give PEFT's tokens and
    log-probs for two adapters and the base in one batch (one prompt, a few tokens: the
    interpreter is slow)."""
    from gpu import assemble
    from gpu.attention.select import get_backend
    from gpu.cuda.backend import CudaBackend

    if not torch.cuda.is_available():
        monkeypatch.setattr(
            assemble, "choose_backend", lambda c, d, t: CudaBackend(get_backend("triton", d))
        )
    base, adapters = lora_models("llama")
    loaded = engine(base, max_num_seqs=4)
    assert isinstance(loaded.core.runner.model.backend, CudaBackend)
    graphs = loaded.core.runner.graphs
    if graphs is None:
        graphs = with_graphs(loaded, [4])
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS]
    names = [None, "all16", "mlp4"]
    few = 4
    want = {n: peft_greedy(base, adapters.get(n), prompts[:1], few, logits=True) for n in names}
    refs = refs_of(loaded, adapters)
    jobs = [(f"{n}-0", prompts[0], refs.get(n)) for n in names]
    got, logprobs = run(loaded.core, jobs, max_tokens=few, logprobs=TOP)
    assert_matches_peft(got, logprobs, want, names, 1)
    assert graphs.num_lora_replays > 0
