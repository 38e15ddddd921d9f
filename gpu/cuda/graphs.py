"""Decode steps replayed as CUDA graphs: one launch for the whole forward pass instead of hundreds.

A decode step's shapes depend only on its batch size, so the model forward is captured once per
size in `capture_sizes` over static input buffers. A step of n decodes copies its inputs into the
first n rows, pads up to the next captured size (padding rows write no K/V: slot -1, and attend to
one harmless slot), replays, and reads back the first n hidden rows. Steps with prefill chunks,
or more decodes than the largest size, run eagerly (speculative decoding's verification steps
have graphs of their own: gpu/cuda/verify_graphs.py). `--enforce-eager` turns all of this off.

With --enable-lora each size is captured twice: without adapters (a step with none runs no
LoRA work) and with them, over static LoRA buffers (gpu/lora.py LoraBatch: each row's slot,
padding rows none, and the rows grouped by slot), which a step with adapters fills before it
replays; the adapters' weights are in static slots already.

Everything the captured kernels read that changes between steps (ids, positions, slots, block
tables, context lengths, the rows' adapters) lives in device memory; the host-side launch
decisions are fixed at capture: the decode kernel's KV split count is chosen for
`max_model_len`, so any context fits, and the LoRA kernels' grids and k split for the size.
The capture itself is injectable (`graph_factory`), so the padding and buffer logic runs in CPU
tests through a stand-in that records the forward and calls it again on replay.

After capture the largest graph is checked once (`check`): replayed over new random ids and
positions, its hidden states must be the eager forward's over the same buffers. A forward that
had decided something on the host from capture-time values (a routing read back, a length)
would replay those values; the check catches it and the step runs eagerly, with a warning,
instead of serving wrong tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.lora import LoraBatch

log = logging.getLogger("weir.cuda_graph")


def replay_or_run(model, kv_caches, graph_sets, input_ids, positions, meta, logits_rows, lora=None):
    """A step's (hidden states, logits): replayed by the first of `graph_sets` that can run it
    (a set without LoRA buffers takes no step with adapters), else the model's eager forward."""
    for graphs in graph_sets:
        if graphs is not None and graphs.can_run(meta) and (lora is None or graphs.lora):
            hidden = graphs.run(input_ids, positions, meta, lora)
            return hidden, model.logits(hidden, logits_rows)
    return model(input_ids, positions, kv_caches, meta, logits_rows, lora)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (capped at 512), as vLLM does."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, top + 1, 8))
    if top not in sizes:
        sizes.append(top)
    return sorted(set(sizes))


class _CudaGraph:
    """Captures fn() once on a side stream into a shared memory pool; replay() reruns it."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class EagerGraph:
    """The stand-in: 'captures' by running fn, replays by running it again (CPU tests)."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: Any) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> torch.Tensor:
        self.output = self.fn()
        return self.output


class DecodeGraphs:
    kind = "decode"

    def __init__(
        self,
        model,
        kv_caches,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        capture_sizes: list[int],
        graph_factory=None,
        query_len: int = 1,  # tokens a row (gpu/cuda/verify_graphs.py: k + 1)
    ) -> None:
        self.query_len = query_len
        self.model, self.kv_caches = model, kv_caches
        self.device = device
        self.max_model_len = max_model_len
        self.sizes = sorted(capture_sizes)
        self.max_size = self.sizes[-1]
        self.graph_factory = graph_factory or _CudaGraph
        n, width = self.max_size, -(-max_model_len // block_size)
        q = self.query_len
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n * q, dtype=i64, device=device)
        self.positions = torch.zeros(n * q, dtype=i64, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros((n, width), dtype=i32, device=device)
        self.seq_lens = torch.full((n,), q, dtype=i32, device=device)
        self.query_start_loc = torch.arange(0, q * (n + 1), q, dtype=i32, device=device)
        self.seq_ids = torch.arange(n, dtype=i32, device=device)
        self.lora: LoraBatch | None = None  # the static LoRA buffers, with --enable-lora
        if getattr(model, "lora", None) is not None and q == 1:
            slots = model.lora.max_loras
            self.lora = LoraBatch(
                torch.full((n,), -1, dtype=i32, device=device),
                torch.zeros(n, dtype=i32, device=device),
                torch.zeros(slots, dtype=i32, device=device),
                torch.zeros(slots, dtype=i32, device=device),
            )
        self.graphs: dict[int, Any] = {}
        self.lora_graphs: dict[int, Any] = {}  # the same sizes, with adapters
        self.num_replays = 0
        self.num_lora_replays = 0  # of those, steps with adapters

    def _meta(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` static rows; host fields describe the padded batch:
        decodes (one token a row), or with more tokens a row the varlen kernel's rows."""
        q, rows, none = self.query_len, self.seq_ids[:size], self.seq_ids[:0]
        decode = q == 1
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: size * q],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            query_lens_cpu=[q] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            decode_seq_ids=rows if decode else none,
            prefill_seq_ids=none if decode else rows,
            decode_seq_ids_cpu=list(range(size)) if decode else [],
            prefill_seq_ids_cpu=[] if decode else list(range(size)),
            # fixes the decode kernel's KV split count for any length
            max_decode_seq_len=self.max_model_len if decode else 0,
            max_prefill_query_len=0 if decode else q,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for size in reversed(self.sizes):  # largest first: later graphs reuse its memory
            meta = self._meta(size)
            variants = [(self.graphs, None)]
            if self.lora is not None:
                variants.append((self.lora_graphs, self._lora(size)))
            for graphs, lora in variants:
                tokens = size * self.query_len

                def forward(tokens=tokens, meta=meta, lora=lora):
                    return self.model.hidden_states(
                        self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, meta, lora
                    )

                if self.device.type == "cuda":
                    forward()  # warm up: compile kernels, settle the allocator outside capture
                    torch.cuda.synchronize(self.device)
                graphs[size] = self.graph_factory(forward, pool)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.check():
            self.graphs.clear()
            self.lora_graphs.clear()
            return
        log.info("captured %s graphs for batch sizes %s", self.kind, self.sizes)

    @torch.inference_mode()
    def check(self, tolerance: float = 1e-2) -> bool:
        """Whether the largest graph, replayed over fresh random ids and positions (no K/V
        written), gives the eager forward's hidden states on the same inputs."""
        size, q = self.max_size, self.query_len
        tokens, meta = size * q, self._meta(size)
        g = torch.Generator().manual_seed(size)
        ids = torch.randint(0, self.model.spec.vocab_size, (tokens,), generator=g)
        positions = torch.randint(0, self.max_model_len - q + 1, (tokens,), generator=g)
        self.input_ids[:tokens].copy_(ids)
        self.positions[:tokens].copy_(positions)
        got = self.graphs[size].replay().float().clone()
        want = self.model.hidden_states(
            self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, meta, None
        ).float()
        self.input_ids.zero_()
        self.positions.zero_()
        nan = torch.isnan(want)  # (equal where both are NaN)
        error = float((got - want).abs().masked_fill(nan, 0).max())
        scale = float(want.abs().masked_fill(nan, 0).max())
        if error <= tolerance * max(scale, 1.0) and bool((torch.isnan(got) == nan).all()):
            return True
        log.warning(
            "%s graphs disabled: a replay over new inputs differs from the eager forward "
            "(max |difference| %.3g over max |value| %.3g); these steps run eagerly",
            self.kind,
            error,
            scale,
        )
        return False

    def _lora(self, size: int) -> LoraBatch:
        rows, order, counts, starts = self.lora
        return LoraBatch(rows[:size], order[:size], counts, starts)

    def padded_size(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Only decode-only steps that fit the largest captured size."""
        n = meta.num_seqs
        return (
            bool(self.graphs)
            and not meta.prefill_seq_ids_cpu
            and 0 < n <= self.max_size
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self, input_ids, positions, meta: AttentionMetadata, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """The step's hidden states; `lora`: its adapters (None: none, and no LoRA work)."""
        n = meta.num_seqs
        size = self.padded_size(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if size > n:  # padding rows: no K/V written, one slot of context, output ignored
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(0)
        graphs = self.graphs
        if lora is not None:  # padding rows: no adapter
            graphs = self.lora_graphs
            rows, order, counts, starts = self.lora
            rows[:n].copy_(lora.rows)
            rows[n:size].fill_(-1)
            order[:n].copy_(lora.order)
            counts.copy_(lora.counts)
            starts.copy_(lora.starts)
            self.num_lora_replays += 1
        self.num_replays += 1
        return graphs[size].replay()[:n]
