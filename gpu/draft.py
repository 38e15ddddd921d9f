"""The draft model of speculative decoding (`"method": "draft_model"`): a small model with the
target's tokenizer that proposes each speculating request's next tokens, greedily.

Its KV cache lives in the same block pool as the target's: one more K and V tensor per draft
layer, indexed by the same block ids and slots (gpu/kv_cache.py sizes a block for both), so the
scheduler, the block tables and the prefix cache serve both models at once. It is kept in step
with the target: every step's rows run through it too (`catch_up`, same inputs and slots), so
its cache holds every position the target's does. Before a step, `propose` fills the
placeholders (-1) of each speculating row: one draft forward per proposed position, batched
over the rows, starting from the row's last known token. Proposals are certain (greedy), so the
sampler's verification keeps the target's own distribution (gpu/sampler.py `verify`).
"""

from __future__ import annotations

import torch

from core.runner_step import SchedulerOutput
from gpu.attention.backend import AttentionMetadata
from gpu.block_tables import StepTables
from gpu.cuda.graphs import DecodeGraphs, replay_or_run
from gpu.cuda.verify_graphs import VerifyGraphs


class DraftModel:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.num_forwards = 0  # draft forwards run (tests count them)
        self.graphs = None  # with CUDA graphs: DecodeGraphs for the proposals' steps
        self.verify_graphs = None  # and VerifyGraphs for catching up with a verification step

    def capture_graphs(
        self,
        max_model_len: int,
        decode_sizes: list[int],
        verify_sizes: list[int],
        num_speculative_tokens: int,
        graph_factory=None,
    ) -> None:
        """The draft's own CUDA graphs over its cache: proposals are decode steps (the target's
        decode sizes), catching up is the target's step again (its verification sizes)."""
        where = (self.model, self.kv_caches, self.device, self.block_size, max_model_len)
        self.graphs = DecodeGraphs(*where, decode_sizes, graph_factory)
        self.graphs.capture()
        if verify_sizes:
            self.verify_graphs = VerifyGraphs(
                *where, verify_sizes, num_speculative_tokens, graph_factory
            )
            self.verify_graphs.capture()

    def _forward(self, input_ids, positions, meta, logits_rows):
        self.num_forwards += 1
        graph_sets = (self.graphs, self.verify_graphs)
        return replay_or_run(
            self.model, self.kv_caches, graph_sets, input_ids, positions, meta, logits_rows
        )

    @torch.inference_mode()
    def catch_up(self, input_ids, positions, meta: AttentionMetadata) -> None:
        """The step's rows through the draft model: its K/V written where the target's is."""
        empty = torch.empty(0, dtype=torch.int64, device=input_ids.device)
        self._forward(input_ids, positions, meta, empty)

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, scheduled, tensor) -> None:
        """Fill every -1 of the entries' `draft_token_ids` with the draft model's greedy
        tokens. `scheduled`: the runner's copies of the entries' requests (token ids, block
        tables); `tensor(data, dtype)`: host data on the device."""
        rows = [(s, r) for s, r in zip(out.scheduled, scheduled) if -1 in s.draft_token_ids]
        if not rows:
            return
        bs = self.block_size
        # position of each row's last known token, and that token
        starts = [s.start + s.num_new_tokens - len(s.draft_token_ids) - 1 for s, _ in rows]
        current = [r.token_ids[p] for (_, r), p in zip(rows, starts)]
        for i in range(max(len(s.draft_token_ids) for s, _ in rows)):
            live = [j for j, (s, _) in enumerate(rows) if i < len(s.draft_token_ids)]
            positions = [starts[j] + i for j in live]
            tables = [rows[j][1].table for j in live]
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
            meta = AttentionMetadata.build(
                slots,
                StepTables.from_lists([list(t) for t in tables]),
                [1] * len(live),
                [p + 1 for p in positions],
                tensor,
            )
            ids = tensor([current[j] for j in live], torch.int64)
            pos = tensor(positions, torch.int64)
            logits_rows = torch.arange(len(live), device=ids.device)
            _, logits = self._forward(ids, pos, meta, logits_rows)
            proposed = logits.argmax(dim=-1).tolist()
            for j, token in zip(live, proposed):
                rows[j][0].draft_token_ids[i] = token
                current[j] = token


def load_draft(config, path: str, dtype: torch.dtype, device: torch.device, target_config):
    """The draft model `path` on the target's device and dtype; refused (a CheckpointError
    naming it) unless its vocabulary is the target's."""
    from core.config import CheckpointError
    from gpu.assemble import choose_backend
    from gpu.loader import load_config, load_model, resolve_model_path

    where = resolve_model_path(path, None)
    draft_config = load_config(where)
    if draft_config.vocab_size != target_config.vocab_size:
        raise CheckpointError(
            f"--speculative-config: the draft model {path} has {draft_config.vocab_size} "
            f"tokens, the model {target_config.vocab_size}: it needs the same tokenizer"
        )
    backend = choose_backend(config, device, dtype)
    return load_model(where, draft_config, dtype, device, backend)
