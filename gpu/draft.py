"""The draft model of speculative decoding (`"method": "draft_model"`): a small model with the
target's tokenizer that proposes each speculating request's next tokens, greedily.

Its KV cache lives in the same block pool as the target's: one more K and V tensor per draft
layer, indexed by the same block ids and slots (gpu/kv_cache.py sizes a block for both), so the
scheduler, the block tables and the prefix cache serve both models at once. It is kept in step
with the target: every step's rows run through it too, so its cache holds every position the
target's does. Before a step, `propose` fills the placeholders (-1) of each speculating row:
one draft forward per proposed position, batched over the rows, starting from the row's last
known token. Proposals are certain (greedy), so the sampler's verification keeps the target's
own distribution (gpu/sampler.py `verify`).

Catching up: a step without proposals runs its rows through the draft as the target ran them
(`catch_up`, the same inputs and slots). A step that verified proposals runs them after the
verdicts instead (`advance`, as vLLM's draft runs on what was accepted): each speculating row
as far as the target kept it (its known tokens, the accepted proposals and the token sampled
after them), so the last position's logits are that row's first proposal for the next step,
kept for `propose`; a request that speculates every step costs k draft forwards a step, not
k + 1. A kept proposal is used only at the position and after the token it was made for; it
changes what is proposed, never what is output.
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
        # request id -> (position, token there, the draft's next token after it): the first
        # proposals `advance` made for the next step
        self.next: dict[str, tuple[int, int, int]] = {}
        self.num_kept_first = 0  # first proposals `propose` took from `advance` (tests count)
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
            k = num_speculative_tokens
            self.verify_graphs = VerifyGraphs(*where, verify_sizes, graph_factory, query_len=k + 1)
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
        self.next = {}

    @torch.inference_mode()
    def advance(self, out: SchedulerOutput, scheduled, sampled: list[int], accepted: list[bool],
                tensor) -> None:  # fmt: skip
        """After a step that verified proposals: its rows through the draft, a speculating one
        up to the token sampled after its accepted proposals (whose logits give its first
        proposal for the next step), the others as the target ran them. `sampled`, `accepted`:
        the sampler's rows (one per verified position of each sampled row)."""
        bs = self.block_size
        ids, positions, slots, tables, query_lens, seq_lens, last, keys = ([] for _ in range(8))
        row = 0  # the sampler's row of the entry's first verified position
        for s, r in zip(out.scheduled, scheduled):
            drafts = s.draft_token_ids
            tokens = r.token_ids[s.start : s.start + s.num_new_tokens - len(drafts)]
            if s.sample and drafts:
                kept = 0
                while kept < len(drafts) and accepted[row + kept]:
                    kept += 1
                tokens = [*tokens, *drafts[:kept]]
                # the sampled token's place: in the row's blocks unless every proposal was
                # kept at a block's end (the next step allocates it; no first proposal then)
                if s.start + len(tokens) < len(r.table) * bs:
                    tokens.append(sampled[row + kept])
                    keys.append((r.request_id, s.start + len(tokens) - 1, tokens[-1]))
                    last.append(len(ids) + len(tokens) - 1)
            elif drafts:  # proposals not verified (a row that samples nothing): as given
                tokens = [*tokens, *drafts]
            if s.sample:
                row += len(drafts) + 1
            pos = range(s.start, s.start + len(tokens))
            ids += tokens
            positions += pos
            slots += (r.table[p // bs] * bs + p % bs for p in pos)
            tables.append(list(r.table))
            query_lens.append(len(tokens))
            seq_lens.append(s.start + len(tokens))
        meta = AttentionMetadata.build(
            slots, StepTables.from_lists(tables), query_lens, seq_lens, tensor
        )
        i64 = torch.int64
        _, logits = self._forward(tensor(ids, i64), tensor(positions, i64), meta, tensor(last, i64))
        proposed = logits.argmax(dim=-1).tolist() if last else []
        self.next = {rid: (p, t, d) for (rid, p, t), d in zip(keys, proposed)}

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
        first = [0] * len(rows)  # the first proposal to make (1: `advance` made the first)
        for j, (s, r) in enumerate(rows):
            kept = self.next.get(r.request_id)
            if kept is not None and kept[:2] == (starts[j], current[j]):
                s.draft_token_ids[0] = current[j] = kept[2]
                first[j] = 1
                self.num_kept_first += 1
        for i in range(max(len(s.draft_token_ids) for s, _ in rows)):
            live = [j for j, (s, _) in enumerate(rows) if first[j] <= i < len(s.draft_token_ids)]
            if not live:
                continue
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
