"""One decoder-only transformer that covers Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma 2 and 3
(their layer's norms in gemma.py), OLMo 2 and 3 (gemma.py's layer without its first norms, Q/K norms
over all heads), Granite (Llama's layer with its factors), SmolLM3 (some layers unrotated),
gpt-oss (gpt_oss.py) and the mixtures of experts Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE
(moe.py), built on a backend.

Module and parameter names follow the Hugging Face checkpoints, so weights load by name without
a mapping. The model is built with one backend (gpu/backend.py), which every layer computes
through; once the checkpoint is read, `prepare` puts each weight in the backend's form (packed,
fused, ...) and asks the backend whether it runs the whole layer stack in one call.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpu.attention.backend import AttentionMetadata
from gpu.dist.parallel import TensorParallel, local_spec
from gpu.models.gemma import sandwich_forward
from gpu.models.layers import Embedding, LayerNorm, Linear, RMSNorm
from gpu.models.mlp import MLP, block_output, mixture, plus_lora
from gpu.models.query_scale import QueryScale
from gpu.models.rope import Rope
from gpu.models.spec import ModelSpec

if TYPE_CHECKING:
    from gpu.lora import LoraBatch


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend, window: int = 0) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = Linear(backend, h, spec.num_heads * d, spec.qkv_bias)
        self.k_proj = Linear(backend, h, spec.num_kv_heads * d, spec.qkv_bias)
        self.v_proj = Linear(backend, h, spec.num_kv_heads * d, spec.qkv_bias)
        self.o_proj = Linear(backend, spec.num_heads * d, h, spec.o_bias)
        self.sinks = None  # gpt-oss's: a logit per head in each softmax's sum (gpt_oss.py)
        if spec.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(spec.num_heads))
        if spec.qk_norm:  # each head's, or OLMo's over all heads at once
            whole = spec.qk_norm_whole
            qn, kn = (spec.num_heads * d, spec.num_kv_heads * d) if whole else (d, d)
            self.q_norm = RMSNorm(qn, spec.rms_norm_eps, backend)
            self.k_norm = RMSNorm(kn, spec.rms_norm_eps, backend)
        self.qk_norm = spec.qk_norm and not spec.qk_norm_whole  # per head, with the rotation
        self.norm_after_rope = spec.qk_norm_after_rope  # Hunyuan's: rotated, then normalized
        self.qk_norm_whole = spec.qk_norm_whole
        self.scale = spec.attn_scale or d**-0.5
        # The checkpoint's FP8 KV cache scales [k, v] (gpu/kv_scales.py), and their use under
        # an FP8 cache (None: unscaled)
        self.kv_scales = [1.0, 1.0]
        self.kv_applied = None
        self.sliding_window = window
        self.softcap = spec.attn_softcap  # Gemma 2's cap on the scores (0: none)
        self.residual_scale = spec.residual_scale  # Granite's, on O's input (1: none)
        self.qkv_clip = spec.qkv_clip
        self.query_scale = None  # Ministral 3's (query_scale.py): the model's, set a step
        self.qkv_sizes = [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d]
        self.o_width = h
        self.qkv = None  # Q/K/V as one product, when the backend fuses them
        self.o = None

    def prepare(self) -> None:
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if self.backend.fuse_qkv:
            self.qkv = self.backend.prepare_stacked([p.take() for p in parts])
            del self.q_proj, self.k_proj, self.v_proj
        else:
            for p in parts:
                p.prepare()
        self.o = self.backend.prepare_linear(*self.o_proj.take())
        del self.o_proj

    def forward(self, x, cos, sin, kv, meta, residual, norm=None, lora=None):
        """residual + attention(x) (attention(x) alone when residual is None); with `norm`, the
        pair (norm(that), that). `lora`: the step's adapters (gpu/lora.py LoraLayer)."""
        b, t = self.backend, x.shape[0]
        add = plus_lora(b, x, lora, "qkv", None, sum(self.qkv_sizes))
        if self.qkv is not None:
            q, k, v = b.linear(x, self.qkv, add).split(self.qkv_sizes, dim=-1)
        elif add is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            qa, ka, va = add.split(self.qkv_sizes, dim=-1)
            q, k, v = self.q_proj(x, qa), self.k_proj(x, ka), self.v_proj(x, va)
        if self.qkv_clip:  # OLMo's clip_qkv
            q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
        if self.qk_norm_whole:  # OLMo's: all heads normalized together, before the split
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        else:
            qw, kw, eps = None, None, 0.0
        scaled = self.kv_applied
        muls = None if scaled is None else (scaled.k_mul, scaled.v_mul)
        if self.norm_after_rope:  # rotated and normalized here, stored unturned (angle 0)
            q = b.rms_norm(b.norm_rope(q, None, 0.0, cos, sin), qw, eps)
            k = b.rms_norm(b.norm_rope(k, None, 0.0, cos, sin), kw, eps)
            qw = kw = None
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        q = b.rope_store_kv(q, k, v, qw, kw, eps, cos, sin, kv, meta.slot_mapping, muls)
        if self.query_scale is not None:
            q = self.query_scale.apply(q)
        scale = self.scale if scaled is None else scaled.score_scale
        o = b.attention.forward(
            q, kv[0], kv[1], meta, scale, self.sliding_window, self.softcap, self.sinks
        )
        o = o.reshape(t, -1)
        if scaled is not None:
            o = o * scaled.out_scale
        if self.residual_scale != 1.0:
            o = o * self.residual_scale
        residual = plus_lora(b, o, lora, "o", residual, self.o_width)
        return block_output(b, o, self.o, residual, norm)


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: ModelSpec, backend, tp: TensorParallel | None = None, index: int = 0
    ) -> None:
        super().__init__()
        window = spec.layer_windows[index] if spec.layer_windows else spec.sliding_window
        self.self_attn = Attention(spec, backend, window)
        self.mlp = mixture(spec, backend) if spec.is_moe_layer(index) else MLP(spec, backend)
        # OLMo 2 has no norms before its blocks: each an identity in the sandwich layer
        first = nn.Identity if spec.post_norms_only else _norm_class(spec)
        self.input_layernorm = first(spec.hidden_size, spec.rms_norm_eps, backend)
        self.parallel = spec.parallel_block  # Cohere's: both blocks on input_layernorm alone
        if not self.parallel:
            norm = _norm_class(spec)  # (Nemotron's second norm: a layer norm too)
            self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.sandwich = spec.sandwich_norms  # Gemma 3's norms after the blocks (gemma.py)
        if self.sandwich:
            self.pre_feedforward_layernorm = first(spec.hidden_size, spec.rms_norm_eps, backend)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        # its sliding layers' rotation (Gemma 3's, OLMo 3's), or none: SmolLM3's and EXAONE 4's
        # NoPE layers turn by the angle 0 (rope_local all zeros: Q and K as they are; EXAONE's
        # sliding layers turn with the model's one rotation)
        if spec.nope_layers:
            self.local_rope = index in spec.nope_layers
        else:
            self.local_rope = bool(spec.layer_windows) and window > 0
        self.tp = tp

    def forward(self, x, h, cos, sin, kv, meta, next_norm: RMSNorm, lora=None):
        """The layer over the residual stream x, given h = input_layernorm(x): (next_norm(y), y)
        of its output y. Each residual add is taken with the norm after it (the next layer's
        first, or the model's last), one backend call that may fuse them. `lora`: the step's
        adapters, or None."""
        if self.sandwich:
            return sandwich_forward(self, x, h, cos, sin, kv, meta, next_norm, lora)
        tp = self.tp
        if self.parallel:  # x + attention(h) + mlp(h), added in transformers' order; under
            # tensor parallelism both partial sums, rank 0's with the residual, in one all-reduce
            first = tp is None or tp.rank == 0
            x = self.self_attn(h, cos, sin, kv, meta, x if first else None, lora=lora)
            x = self.mlp(h, x, lora=lora)  # (next_norm a layer norm: not fused into the add)
            x = x if tp is None else tp.all_reduce(x)
            return next_norm(x), x
        if tp is None:
            h, x = self.self_attn(h, cos, sin, kv, meta, x, self.post_attention_layernorm, lora)
            return self.mlp(h, x, next_norm, lora)
        # Row-parallel O and down: each rank's product is a partial sum; rank 0 adds the
        # residual as it writes its own, and one all-reduce per product completes both (an
        # adapter's delta of O or down is a partial sum too: A is sharded as the layer's input).
        first = tp.rank == 0
        x = tp.all_reduce(
            self.self_attn(h, cos, sin, kv, meta, residual=x if first else None, lora=lora)
        )
        h = self.post_attention_layernorm(x)
        x = tp.all_reduce(self.mlp(h, x if first else None, lora=lora))
        return next_norm(x), x


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(backend, spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, backend, tp, i) for i in range(spec.num_layers)
        )
        self.norm = _norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, backend)


def _norm_class(spec: ModelSpec):
    """The layers' and the model's norm: RMSNorm, or a mean-centred layer norm (Cohere's;
    Nemotron's with a bias)."""
    if not spec.layer_norm:
        return RMSNorm
    return partial(LayerNorm, bias=spec.norm_bias, weightless=spec.norm_weightless)


class DecoderForCausalLM(nn.Module):
    """`spec` is the checkpoint's; with `tp` (gpu/dist/parallel.py) the modules hold one rank's
    share (`local_spec`), and the embedding and logits are assembled across ranks."""

    pooling_only = False  # it generates (an encoder, gpu/models/encoder.py, does not)

    def __init__(self, spec: ModelSpec, backend, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.local_spec = local_spec(spec, self.tp) if self.tp else spec
        local = self.local_spec
        self.model = DecoderModel(local, backend, self.tp)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(backend, local.hidden_size, local.vocab_size, spec.head_bias)
        # A sequence classifier's head (its checkpoint's `score`), whole on every rank
        labels = spec.num_labels
        self.score = nn.Linear(spec.hidden_size, labels, False) if labels else None
        self.rope: Rope | None = None  # set after weights are on their device (see loader)
        self.rope_local: Rope | None = None  # Gemma 3's sliding layers' own rotation
        self._embed_factor: float | None = None  # spec.embed_scale in the embeddings' dtype
        self.stack = None  # the backend's whole-stack call, when it runs this model so
        self.lora = None  # gpu/lora.py LoraSlots: the adapters' slots, with --enable-lora
        # Ministral 3's attention temperature: one per model, each step's factors, every
        # layer's attention reading them
        self.query_scale = None
        if spec.query_scale_beta:
            self.query_scale = QueryScale(spec.query_scale_beta, spec.query_scale_length)
            for layer in self.model.layers:
                layer.self_attn.query_scale = self.query_scale

    def prepare(self) -> None:
        """After loading: every weight in the backend's form; then the stack, if the backend
        runs this model as one call (it logs why not)."""
        self.model.embed_tokens.prepare()
        for norm in self.modules():  # (OLMo's weightless layer norms: their ones)
            if isinstance(norm, LayerNorm):
                norm.prepare()
        for layer in self.model.layers:
            layer.self_attn.prepare()
            layer.mlp.prepare()
        if not self.spec.tie_word_embeddings:
            self.lm_head.prepare()
        self.stack = self.backend.stack(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final hidden states [tokens, hidden], the logits [len(logits_rows), vocab] of
        the rows `logits_rows`). `lora`: each token's adapter slot in `self.lora`
        (gpu/lora.py LoraBatch), or None: no adapter in the step."""
        if self.stack is not None:
            # The compiled call gathers the embeddings and rotary rows itself, and takes the LM
            # head's rows too when the head is on its path.
            cos, sin = self.rope.tables(max(meta.seq_lens_cpu, default=0), torch.float32)
            hidden, logits = self.stack(
                input_ids, positions, cos, sin, kv_caches, meta, logits_rows, lora
            )
            if logits is None:
                return hidden, self.logits(hidden, logits_rows)
            return hidden, self.soft_capped(logits)
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, lora)
        return hidden, self.logits(hidden, logits_rows)

    def hidden_states(self, input_ids, positions, kv_caches, meta, lora=None) -> torch.Tensor:
        """The final hidden states, layer by layer (what CUDA graphs capture)."""
        x = self.embed(input_ids)
        if self.query_scale is not None:
            self.query_scale.set(positions)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        local = self.rope_local.cos_sin(positions, x.dtype) if self.rope_local else (cos, sin)
        layers = self.model.layers
        # Each layer applies the norm that follows it: the next layer's first, the model's last.
        nexts = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        h = nexts[0](x) if len(layers) == 0 else layers[0].input_layernorm(x)
        for i, (layer, kv, norm) in enumerate(zip(layers, kv_caches, nexts)):
            adapters = self.lora.layer(i, lora) if lora is not None else None
            c, s = local if layer.local_rope else (cos, sin)
            h, x = layer(x, h, c, s, kv, meta, norm, adapters)
        return h

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The logits of `rows` of hidden (all of them, 0..n-1, read in place)."""
        if rows.numel() == 0:
            return torch.empty(0, self.spec.vocab_size, device=hidden.device)
        last = hidden if rows.numel() == hidden.shape[0] else hidden[rows]
        return self.compute_logits(last)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self._embed(input_ids)
        if self.spec.embed_scale != 1.0:  # Gemma's, rounded to the embeddings' dtype first
            if self._embed_factor is None:  # once: the dtype is the model's
                self._embed_factor = torch.tensor(self.spec.embed_scale, dtype=x.dtype).item()
            x = x * self._embed_factor
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        # Vocabulary-parallel: this rank's rows give their embeddings, others zeros; the
        # all-reduce sums in the one rank's non-zero row per token.
        rows = self.model.embed_tokens.num_embeddings
        local = input_ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = self.model.embed_tokens(local.clamp(0, rows - 1))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            logits = self.backend.tied_logits(hidden, self.model.embed_tokens.w)
        else:
            logits = self.lm_head(hidden)
        if self.tp is not None:  # each rank's vocabulary rows, side by side, less the padding
            logits = self.tp.all_gather_last(logits)[..., : self.spec.vocab_size]
        return self.soft_capped(logits.float())

    @property
    def classifies(self) -> bool:
        return self.score is not None

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's raw logits [labels] for the final rows of one input's last
        chunk (its last token's row), in float32."""
        return self.score.weight.float() @ rows[-1].float()

    def soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's divisor and Gemma 2's final soft cap, as transformers applies them (the
        logits as they are else)."""
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_softcap
        if not cap:
            return logits
        return torch.tanh(logits / cap) * cap
