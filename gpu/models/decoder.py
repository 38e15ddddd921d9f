"""One decoder-only transformer that covers Llama, Mistral, Qwen2 and Qwen3.

Module names follow the Hugging Face checkpoints, so weights load by name without a mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.backend import AttentionBackend, AttentionMetadata
from gpu.models.rope import Rope, apply_rope
from gpu.models.spec import ModelSpec
from gpu.dist.parallel import TensorParallel, local_spec

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side: one matrix product instead of
    several, on the same weights (used after loading, which goes by the checkpoint's names)."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused


def add_product(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x); a layer that can add as it writes its product (gpu/cpu/onednn.py's
    PackedLinear) does, saving a pass over the output."""
    binary = getattr(linear, "forward_binary", None)
    if binary is not None:
        return binary(x, residual, "add")
    return residual + linear(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # gpu/cpu/norm.py's CpuNorm, set by the loader on CPU in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.scale = d**-0.5
        self.sliding_window = spec.sliding_window
        self.qkv_proj: nn.Linear | None = None  # set by fuse()
        self.qkv_sizes = [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d]
        # Q/K norm and rotation in one pass (gpu/cpu/norm.py), set by the loader on CPU in float32.
        self.norm_rope = None

    def fuse(self) -> None:
        if self.qkv_proj is not None:  # fused already (the loader fuses on CUDA)
            return
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta, backend, residual):
        """residual + attention(x) (attention(x) alone when residual is None)."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.norm_rope is not None:
            if self.qk_norm:
                qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            else:
                qw, kw, eps = None, None, 0.0
            q, k = self.norm_rope(q, qw, eps, cos, sin), self.norm_rope(k, kw, eps, cos, sin)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        if residual is None:
            return self.o_proj(o.reshape(t, -1))
        return add_product(self.o_proj, o.reshape(t, -1), residual)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(h, m, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(m, h, bias=spec.mlp_bias)
        self.hidden_act = spec.hidden_act
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x, residual=None):
        """mlp(x), plus residual when given."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = self.act(gate) * up
        return self.down_proj(h) if residual is None else add_product(self.down_proj, h, residual)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.tp = tp

    def forward(self, x, cos, sin, kv, meta, backend):
        tp = self.tp
        if tp is None:
            x = self.self_attn(self.input_layernorm(x), cos, sin, kv, meta, backend, residual=x)
            return self.mlp(self.post_attention_layernorm(x), residual=x)
        # Row-parallel O and down: each rank's product is a partial sum; rank 0 adds the
        # residual as it writes its own, and one all-reduce per product completes both.
        first = tp.rank == 0
        h = self.self_attn(
            self.input_layernorm(x), cos, sin, kv, meta, backend, residual=x if first else None
        )
        x = tp.all_reduce(h)
        return tp.all_reduce(self.mlp(self.post_attention_layernorm(x), x if first else None))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """`spec` is the checkpoint's; with `tp` (gpu/dist/parallel.py) the modules hold one rank's
    share (`local_spec`), and the embedding and logits are assembled across ranks."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.local_spec = local_spec(spec, self.tp) if self.tp else spec
        local = self.local_spec
        self.model = DecoderModel(local, self.tp)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(local.hidden_size, local.vocab_size, bias=False)
        self.rope: Rope | None = None  # set after weights are on their device (see loader)
        # gpu/cpu/forward.py's CpuForward: all layers in one compiled call, set by the loader on
        # CPU in float32 when every layer runs on the CPU kernels.
        self.cpu_forward = None

    def fuse_projections(self) -> None:
        """Q/K/V into one matrix product and gate/up into another, per layer (after loading)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_rows: torch.Tensor | None = None,
    ):
        """The final hidden states [tokens, hidden]. With `logits_rows`, (those, the logits of
        those rows) when the compiled CPU call can take the LM head too, else (those, None):
        the caller runs compute_logits."""
        cpu = self.cpu_forward
        if cpu is not None and cpu.usable(kv_caches, backend):
            # The compiled call gathers the embeddings and rotary rows itself.
            embed = self.model.embed_tokens.weight
            cos, sin = self.rope.tables(max(meta.seq_lens_cpu, default=0), embed.dtype)
            args = (input_ids, positions, cos, sin, kv_caches, meta)
            if logits_rows is None:
                return cpu(*args)
            if cpu.lm_head is not None and logits_rows.numel() > 0:
                return cpu(*args, logits_rows)
            return cpu(*args), None
        x = self.embed(input_ids)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta, backend)
        hidden = self.model.norm(x)
        return hidden if logits_rows is None else (hidden, None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
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
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp is not None:  # each rank's vocabulary rows, side by side, less the padding
            logits = self.tp.all_gather_last(logits)[..., : self.spec.vocab_size]
        return logits.float()
