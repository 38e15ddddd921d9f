"""A BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa, MPNet) on a backend: every input attends
to the whole of itself, so a step holds each of its inputs whole (the scheduler never chunks
them, core/scheduler.py `whole_prompts`) and nothing is cached: each input's K/V live only in
its step, and the model holds no KV cache. It embeds (gpu/pooler.py pools its final rows) and,
with a head, classifies from its first token's row; it never generates.

The layer is BERT's, norms after each block: LayerNorm(x + attention(x)), then
LayerNorm(x + dense(act(dense(x)))); the input is the token's embedding plus its segment's
(BERT's token type: a pair's second text is type 1) plus its position's (RoBERTa's and
MPNet's counted past their padding id). MPNet adds to each head's scores a learned bias by the
two tokens' bucketed distance. Products run on the backend as a decoder's do (Q/K/V one
product); the norms, the activation and the attention are torch's (attention per input,
scaled_dot_product_attention, MPNet's bias its additive mask).

Module and parameter names follow the Hugging Face checkpoints (after the classifiers' `bert.` /
`roberta.` prefix), so weights load by name (gpu/encoder_loader.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.backend import AttentionMetadata
from gpu.models.encoder_spec import EncoderSpec
from gpu.models.layers import Embedding, Linear


class Embeddings(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        h = spec.hidden_size
        self.word_embeddings = Embedding(backend, spec.vocab_size, h)
        # (none where positions are not a table: JinaBERT's ALiBi)
        rows = spec.position_rows
        self.position_embeddings = nn.Embedding(rows, h) if rows else None
        self.token_type_embeddings = (
            nn.Embedding(spec.type_vocab_size, h) if spec.type_vocab_size else None
        )
        self.LayerNorm = nn.LayerNorm(h, spec.layer_norm_eps)
        self.roberta = spec.family in ("roberta", "mpnet")
        self.pad = spec.pad_token_id

    def forward(self, input_ids, positions, meta: AttentionMetadata, token_types) -> torch.Tensor:
        x = self.word_embeddings(input_ids).to(self.LayerNorm.weight.dtype)
        if self.token_type_embeddings is not None:
            if token_types is None:  # every token the first segment's
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_types)
        if self.position_embeddings is None:
            return self.LayerNorm(x)
        if self.roberta:
            positions = roberta_positions(input_ids, meta, self.pad)
        return self.LayerNorm(x + self.position_embeddings(positions))


def roberta_positions(input_ids: torch.Tensor, meta: AttentionMetadata, pad: int) -> torch.Tensor:
    """RoBERTa's positions, as transformers counts them: each input's tokens that are not its
    padding id numbered from pad + 1 on, a padding token at `pad` itself."""
    keep = (input_ids != pad).long()
    counts = keep.cumsum(0)
    starts = meta.query_start_loc[:-1].long()
    before = torch.cat([counts.new_zeros(1), counts])[starts]  # kept tokens of earlier inputs
    lens = meta.query_start_loc.diff().long()
    counts = counts - torch.repeat_interleave(before, lens, output_size=input_ids.numel())
    return counts * keep + pad


def token_types(lengths: list[int], starts: list[int | None]) -> list[int] | None:
    """Each token's segment over a step's inputs of `lengths`, the second segment from
    `starts` on (None: one text), or None where every token is the first segment's."""
    if all(t is None for t in starts):
        return None
    types: list[int] = []
    for n, start in zip(lengths, starts):
        first = n if start is None else min(start, n)
        types += [0] * first + [1] * (n - first)
    return types


class SelfAttention(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        h = spec.hidden_size
        self.query = Linear(backend, h, h, True)
        self.key = Linear(backend, h, h, True)
        self.value = Linear(backend, h, h, True)


class Output(nn.Module):
    """A block's output product (with its bias), the residual, then the block's LayerNorm."""

    def __init__(self, spec: EncoderSpec, backend, width: int) -> None:
        super().__init__()
        self.dense = Linear(backend, width, spec.hidden_size, True)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, spec.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h, residual))


class Attention(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.backend = backend
        self.self = SelfAttention(spec, backend)
        self.output = Output(spec, backend, spec.hidden_size)
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = None  # Q/K/V as one product

    def prepare(self) -> None:
        s = self.self
        self.qkv = self.backend.prepare_stacked([p.take() for p in (s.query, s.key, s.value)])
        del self.self
        self.output.dense.prepare()

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, biases=None, alibi=None
    ) -> torch.Tensor:
        """`biases`: MPNet's, each input length's [heads, n, n] added to the scores; `alibi`:
        JinaBERT's slopes (bidirectional)."""
        t = x.shape[0]
        q, k, v = self.backend.linear(x, self.qkv).view(t, 3, self.num_heads, -1).unbind(1)
        o = bidirectional(q, k, v, meta.query_lens_cpu, biases=biases, alibi=alibi)
        return self.output(o.view(t, -1), x)


def bidirectional(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    window: int = 0,
    biases: dict[int, torch.Tensor] | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of [tokens, heads, head_dim] Q/K/V where each input (of `lengths`, one after
    another) attends to the whole of itself and nothing else; with `window`, a token only to
    those at most `window` positions away either way (ModernBERT's local layers); `biases`: by
    input length, [heads, n, n] added to the scaled scores (MPNet's relative positions);
    `alibi`: [heads] slopes, each head's scores less its slope times |i - j| (JinaBERT's)."""
    o = torch.empty_like(q)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        if alibi is not None:
            o[part] = _alibi_attention(q[part], k[part], v[part], alibi)
            start += n
            continue
        # [1, heads, n, head_dim] views: torch's fused CPU kernel takes 4-D inputs only (3-D
        # ones fell to its unfused path, 1.75x slower)
        q_, k_, v_ = (z[part].transpose(0, 1)[None] for z in (q, k, v))
        mask = None
        if window and n > window + 1:
            i = torch.arange(n, device=q.device)
            mask = (i[:, None] - i[None, :]).abs() <= window
        if biases is not None:
            mask = biases[n][None].to(q.dtype)
        o[part] = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)[0].transpose(0, 1)
        start += n
    return o


def _alibi_attention(q, k, v, slopes: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """One input's attention under symmetric ALiBi biases, its queries `block` rows at a time
    (the bias of a block is [heads, block, n], not [heads, n, n]: 3.2 GB at 8,192 tokens)."""
    n = q.shape[0]
    keys = torch.arange(n, device=q.device, dtype=torch.float32)
    k_, v_ = (z.transpose(0, 1)[None] for z in (k, v))
    out = torch.empty_like(q)
    for s in range(0, n, block):
        rows = slice(s, min(s + block, n))
        distance = (keys[rows, None] - keys[None, :]).abs()
        bias = (-slopes.float()[:, None, None] * distance)[None].to(q.dtype)
        q_ = q[rows].transpose(0, 1)[None]
        out[rows] = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=bias)[0].transpose(0, 1)
    return out


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's head slopes: for a power of two n, 2 ** (-8 (i + 1) / n); otherwise the nearest
    lower power's, then every other slope of twice that many heads (the ALiBi paper's, as
    JinaBERT computes them)."""

    def powers(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(heads).is_integer():
        return torch.tensor(powers(heads))
    low = 2 ** math.floor(math.log2(heads))
    return torch.tensor(powers(low) + powers(2 * low)[0::2][: heads - low])


class Intermediate(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.dense = Linear(backend, spec.hidden_size, spec.intermediate_size, True)


class Layer(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.attention = Attention(spec, backend)
        self.intermediate = Intermediate(spec, backend)
        self.output = Output(spec, backend, spec.intermediate_size)
        self.backend, self.act = backend, spec.hidden_act

    def prepare(self) -> None:
        self.attention.prepare()
        self.intermediate.dense.prepare()
        self.output.dense.prepare()

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, biases=None) -> torch.Tensor:
        x = self.attention(x, meta, biases)
        h = self.backend.linear_act(x, self.intermediate.dense.w, self.act)
        return self.output(h, x)


class Encoder(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(spec, backend) for _ in range(spec.num_layers))
        self.relative_attention_bias = None  # MPNet's: [buckets, heads], for every layer
        if spec.relative_buckets:
            self.relative_attention_bias = nn.Embedding(spec.relative_buckets, spec.num_heads)

    def biases(self, lengths: list[int]) -> dict[int, torch.Tensor] | None:
        """MPNet's score biases for inputs of `lengths`: [heads, n, n] by each length, of the
        bucket of each key's distance from its query (transformers' buckets: 32, exact to 8
        either way, logarithmic to 128), or None."""
        table = self.relative_attention_bias
        if table is None:
            return None
        out = {}
        for n in set(lengths):
            i = torch.arange(n, device=table.weight.device)
            out[n] = table(relative_bucket(i[None, :] - i[:, None])).permute(2, 0, 1)
        return out


def relative_bucket(relative: torch.Tensor, buckets: int = 32, max_distance: int = 128):
    """transformers' MPNet (T5's) buckets of key-minus-query distances: half the buckets for
    each sign, exact below a quarter of them, then logarithmic up to max_distance."""
    half = buckets // 2
    n = -relative
    out = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = (
        exact
        + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    )
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return out + torch.where(n < exact, n, large)


class Pooler(nn.Module):  # BERT's: dense then tanh over the first token's row
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size)


class RobertaHead(nn.Module):  # RoBERTa's classifier: dense, tanh, out_proj
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.num_labels)


class Encoding(nn.Module):
    """What the runner (gpu/runner.py) reads of an encoder, this one's or ModernBERT's
    (gpu/models/modernbert.py): it pools and never generates, each input whole in a step;
    `classifier` is its head's last product (None: an embedding model)."""

    pooling_only = True
    tp = None  # (tensor parallelism, LoRA and the one-call stack are refused for encoders)
    lora = None
    stack = None
    classifier: nn.Module | None

    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.spec = self.local_spec = spec
        self.backend = backend

    @property
    def classifies(self) -> bool:
        return self.classifier is not None

    @staticmethod
    def check_whole(meta: AttentionMetadata) -> None:
        if meta.query_lens_cpu != meta.seq_lens_cpu:
            raise ValueError("an encoder's inputs are run whole, in one step each")

    def segments(
        self, meta: AttentionMetadata, type_starts: list[int | None] | None, device
    ) -> torch.Tensor | None:
        """Each token's segment (token type) over the step's inputs, or None where every token
        is the first segment's (one text each, or a model of one segment)."""
        if type_starts is None or self.spec.type_vocab_size <= 1:
            return None
        types = token_types(meta.query_lens_cpu, type_starts)
        return None if types is None else torch.tensor(types, dtype=torch.int64, device=device)


class EncoderModel(Encoding):
    """An encoder on `backend`; with a head (spec.head), a sequence classifier."""

    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__(spec, backend)
        self.embeddings = Embeddings(spec, backend)
        self.encoder = Encoder(spec, backend)
        self.pooler = Pooler(spec) if spec.head == "bert" else None
        if spec.head == "bert":
            self.classifier = nn.Linear(spec.hidden_size, spec.num_labels)
        elif spec.head == "roberta":
            self.classifier = RobertaHead(spec)
        elif spec.head == "token":
            self.classifier = nn.Linear(spec.hidden_size, spec.num_labels)
        else:
            self.classifier = None
        if spec.head == "bge_m3":  # its sparse weights' and ColBERT vectors' heads
            self.sparse_linear = nn.Linear(spec.hidden_size, 1)
            self.colbert_linear = nn.Linear(spec.hidden_size, spec.hidden_size)

    def prepare(self) -> None:
        """After loading: each product in the backend's form; the head in float32."""
        self.embeddings.word_embeddings.prepare()
        for layer in self.encoder.layer:
            layer.prepare()
        heads = [self.pooler, self.classifier]
        if self.spec.head == "bge_m3":
            heads += [self.sparse_linear, self.colbert_linear]
        for head in heads:
            if head is not None:
                head.float()

    @property
    def classifies(self) -> bool:
        return self.classifier is not None or self.spec.head == "bge_m3"

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        type_starts: list[int | None] | None = None,
    ) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of the step's inputs, each whole (its
        positions from 0: what the scheduler gives an encoder); `type_starts`: where each
        input's second segment starts (BERT's pairs; None: one text)."""
        self.check_whole(meta)
        types = self.segments(meta, type_starts, input_ids.device)
        x = self.embeddings(input_ids, positions, meta, types)
        biases = self.encoder.biases(meta.query_lens_cpu)
        for layer in self.encoder.layer:
            x = layer(x, meta, biases)
        return x

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """A classifier's raw logits [labels] for one input's final rows (its first token's:
        BERT's [CLS], RoBERTa's <s>), in float32; a token classifier's [tokens, labels], every
        row's."""
        if self.spec.head == "token":
            return self.classifier(rows.float())
        if self.spec.head == "bge_m3":  # (its sparse weights, before their ReLU)
            return self.sparse_linear(rows.float())
        first = rows[0].float()
        if self.pooler is not None:
            return self.classifier(torch.tanh(self.pooler.dense(first)))
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(first)))
