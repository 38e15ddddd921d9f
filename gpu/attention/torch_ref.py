"""Reference paged attention in plain torch: the CPU path and the yardstick for the GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.attention.backend import AttentionMetadata
from gpu.kv_cache import E4M3_MAX


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] cache, one block table -> [H, length, D] contiguous context."""
    block_size = cache.shape[1]
    n = -(-length // block_size)
    ctx = cache[table[:n]].flatten(0, 1)[:length]
    return ctx.transpose(0, 1)


def _exact(query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks) -> torch.Tensor:
    """Attention with Gemma 2's soft cap on the scores (softcap * tanh(score / softcap), before
    the mask and the softmax, as transformers computes it) or gpt-oss's sinks (a logit per head
    in the softmax, dropped after it), one sequence at a time: scaled dot product attention has
    no place for either."""
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        q = query[start : start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        k = _gather(k_cache, meta.block_tables[i], seq_len).float()  # [Hkv, seq_len, D]
        v = _gather(v_cache, meta.block_tables[i], seq_len).float()
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = pos <= qpos
        if sliding_window > 0:
            mask &= pos > qpos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = (probs @ v).transpose(0, 1).to(out.dtype)
        start += q_len
    return out


class TorchAttention:
    name = "torch"
    # Host syncs (masks of valid slots, per-sequence lengths) that a CUDA graph cannot capture:
    # decode steps on this backend run eagerly.
    graph_safe = False

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        if k_cache.dtype == torch.float8_e4m3fn:  # saturated, as vLLM writes it (not NaN)
            key, value = key.clamp(-E4M3_MAX, E4M3_MAX), value.clamp(-E4M3_MAX, E4M3_MAX)
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value.to(v_cache.dtype)

    def _decode_group(
        self, seqs, starts, query, k_cache, v_cache, meta, scale, sliding_window, gqa, out
    ) -> None:
        """One padded batch of single-token rows: gather contexts, mask the padding, SDPA."""
        idx = torch.tensor(seqs, device=query.device)
        lens = meta.seq_lens[idx].long()
        max_len = max(meta.seq_lens_cpu[i] for i in seqs)
        block_size = k_cache.shape[1]
        nb = -(-max_len // block_size)
        tables = meta.block_tables[idx, :nb].long()
        k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        rows = torch.tensor([starts[i] for i in seqs], device=query.device)
        q = query[rows].unsqueeze(2)  # [B, H, 1, D]
        pos = torch.arange(max_len, device=query.device)[None, :]
        mask = pos < lens[:, None]
        if sliding_window > 0:
            mask &= pos >= lens[:, None] - sliding_window
        o = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = o.squeeze(2)

    def forward(
        self,
        query,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ):
        if softcap or sinks is not None:
            return _exact(query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
        out = torch.empty_like(query)
        gqa = query.shape[1] != k_cache.shape[2]
        starts = [0]
        for q in meta.query_lens_cpu:
            starts.append(starts[-1] + q)
        decodes, prefills = meta.decode_seq_ids_cpu, meta.prefill_seq_ids_cpu

        if decodes:
            # Single-token rows, batched: sorted by context length and cut into a few groups so
            # each group pads (and gathers) only to its own longest context.
            order = sorted(decodes, key=lambda i: meta.seq_lens_cpu[i])
            groups = max(1, min(4, len(order) // 16))
            size = -(-len(order) // groups)
            for g in range(0, len(order), size):
                self._decode_group(
                    order[g : g + size],
                    starts,
                    query,
                    k_cache,
                    v_cache,
                    meta,
                    scale,
                    sliding_window,
                    gqa,
                    out,
                )

        for i in prefills:
            s, e = starts[i], starts[i + 1]
            q_len, seq_len = e - s, meta.seq_lens_cpu[i]
            k = _gather(k_cache, meta.block_tables[i], seq_len).unsqueeze(0)
            v = _gather(v_cache, meta.block_tables[i], seq_len).unsqueeze(0)
            q = query[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            # Query row j sits at position seq_len - q_len + j and sees keys up to there.
            qpos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            pos = torch.arange(seq_len, device=query.device)[None, :]
            mask = pos <= qpos[:, None]
            if sliding_window > 0:
                mask &= pos > qpos[:, None] - sliding_window
            o = F.scaled_dot_product_attention(
                q,
                k.to(q.dtype),
                v.to(q.dtype),
                attn_mask=mask[None, None],
                scale=scale,
                enable_gqa=gqa,
            )
            out[s:e] = o[0].transpose(0, 1)
        return out
