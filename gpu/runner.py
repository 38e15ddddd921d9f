"""ModelRunner: a scheduler step -> flat tensors -> one forward pass -> sampled token ids."""

from __future__ import annotations

import torch

from core.scheduler import SchedulerOutput
from gpu.attention.backend import AttentionBackend, AttentionMetadata
from gpu.models.decoder import DecoderForCausalLM
from gpu.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.vocab_size = model.spec.vocab_size
        self.sampler = Sampler(seed, device)
        self.last_logits: torch.Tensor | None = None  # kept for tests that compare logits

    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, out: SchedulerOutput):
        """Flatten the step: input ids, positions, slot mapping, block tables, logits rows."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        max_blocks = max(len(s.block_table) for s in out.seqs)
        tables: list[list[int]] = []
        for s in out.seqs:
            n, start, table = s.num_new_tokens, s.start, s.block_table
            input_ids.extend(s.token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table + [0] * (max_blocks - len(table)))
            if s.sample:
                logits_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(slots, tables, query_lens, seq_lens, self._tensor)
        return (
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(logits_rows, torch.int64),
        )

    def _generator(self, request) -> torch.Generator:
        """A request's own generator, made from its seed on first use and kept on the request."""
        if request.sampler_state is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(request.sampling_params.seed)
            request.sampler_state = g
        return request.sampler_state

    def prepare_sampling(self, out: SchedulerOutput):
        requests = [s.request for s in out.seqs if s.sample]
        params = [r.sampling_params for r in requests]
        temps = [p.temperature for p in params]
        top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_ps = [p.top_p for p in params]
        return dict(
            temperature=self._tensor(temps, torch.float32),
            top_k=self._tensor(top_ks, torch.int64),
            top_p=self._tensor(top_ps, torch.float32),
            all_greedy=all(p.greedy for p in params),
            need_top_k=any(k > 0 for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            seeded=[(i, self._generator(r)) for i, r in enumerate(requests)
                    if r.sampling_params.seed is not None and not r.sampling_params.greedy],
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int]:
        input_ids, positions, meta, logits_rows = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        if logits_rows.numel() == 0:
            return []
        logits = self.model.compute_logits(hidden[logits_rows])
        self.last_logits = logits
        ids = self.sampler(logits, **self.prepare_sampling(out))
        return ids.tolist()
