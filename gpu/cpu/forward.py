"""The CPU float32 forward in one compiled call (gpu/cpu/csrc/forward.cpp).

After loading, a model whose every layer runs on the CPU kernels (weir's packed products, the
norm/rotary kernel, the paged attention kernel) gets a CpuForward: DecoderForCausalLM.forward
then embeds the tokens and computes the rotary tables in torch and hands the whole layer stack
and the final norm to C++, which calls the same kernels in the same order as the modules do
(bitwise the same hidden states) without a dozen op dispatches per layer in between.
WEIR_CPU_FORWARD=modules keeps the module-by-module path (for A/B benchmarks).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.cpu.attention import DTYPES
from gpu.cpu import build as cpu_build

log = logging.getLogger("weir.cpu_forward")

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _p)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "q_norm",
            "k_norm",
            "o",
            "gate_up",
            "down",
            "k_cache",
            "v_cache",
        )
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *[(n, _i64) for n in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")],
        *[(n, _i64) for n in ("num_layers", "block_size", "sliding_window")],
        ("eps", _f32),
        ("scale", _f32),
        ("act", _i64),
        ("cache_dtype", _i64),
        ("layers", _p),
        ("final_norm", _p),
        ("lm_head", _p),
        ("vocab", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _i64),
        ("x", _p),
        ("out", _p),
        ("slots", _p),
        ("block_tables", _p),
        ("max_blocks", _i64),
        ("query_start", _p),
        ("seq_lens", _p),
        ("num_seqs", _i64),
        ("num_threads", _i64),
        ("input_ids", _p),
        ("embed", _p),
        ("vocab", _i64),
        ("positions", _p),
        ("cos_table", _p),
        ("sin_table", _p),
        ("table_rows", _i64),
        ("logits_rows", _p),
        ("num_logits", _i64),
        ("logits", _p),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def unfit(model) -> str | None:
    """Why `model` cannot run as one call (None when it can)."""
    from gpu.cpu.gemm import GemmGatedMLP, GemmLinear

    if os.environ.get("WEIR_CPU_FORWARD", "fused") == "modules":
        return "WEIR_CPU_FORWARD=modules"
    if model.tp is not None:
        return "tensor parallel"
    if model.model.norm.kernel is None:
        return "no norm kernel"
    embed = model.model.embed_tokens.weight
    if embed.dtype != torch.float32 or not embed.is_contiguous():
        return "embeddings not float32 and contiguous"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn.qkv_proj, GemmLinear) or not isinstance(attn.o_proj, GemmLinear):
            return "attention products not on weir's kernel"
        if attn.o_proj.bias is not None:
            return "an output projection bias"
        if not isinstance(mlp, GemmGatedMLP):
            return "MLP not a packed gated pair"
        if attn.norm_rope is None or layer.input_layernorm.kernel is None:
            return "no norm kernel"
    if len({layer.self_attn.sliding_window for layer in model.model.layers}) > 1:
        return "per-layer sliding windows"
    return None


class CpuForward:
    def __init__(self, model) -> None:
        self._lib = cpu_build.load()
        self.model = model
        self._caches: list | None = None  # the kv_caches list the layer table points into
        self._layers = None
        self._struct = None
        # The LM head when the call can take it too: an untied, bias-free one on weir's kernel
        # (a tied head multiplies by the embedding's plain weight, through torch).
        from gpu.cpu.gemm import GemmLinear

        head = getattr(model, "lm_head", None)
        tied = model.spec.tie_word_embeddings
        ok = isinstance(head, GemmLinear) and head.bias is None and not tied
        self.lm_head = head if ok else None

    def _bind(self, kv_caches) -> None:
        model, spec = self.model, self.model.local_spec
        layers = model.model.layers
        table = (_Layer * len(layers))()
        for entry, layer, (k, v) in zip(table, layers, kv_caches):
            attn = layer.self_attn
            entry.input_norm = _ptr(layer.input_layernorm.weight)
            entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            entry.qkv = _ptr(attn.qkv_proj.packed)
            entry.qkv_bias = _ptr(attn.qkv_proj.bias)
            entry.q_norm = _ptr(attn.q_norm.weight) if attn.qk_norm else None
            entry.k_norm = _ptr(attn.k_norm.weight) if attn.qk_norm else None
            entry.o = _ptr(attn.o_proj.packed)
            entry.gate_up = _ptr(layer.mlp.gate_up)
            entry.down = _ptr(layer.mlp.down_proj.packed)
            entry.k_cache, entry.v_cache = _ptr(k), _ptr(v)
        first = layers[0]
        self._struct = _Model(
            hidden=spec.hidden_size,
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate=first.mlp.width,
            num_layers=len(layers),
            block_size=kv_caches[0][0].shape[1],
            sliding_window=first.self_attn.sliding_window or 0,
            eps=model.model.norm.eps,
            scale=first.self_attn.scale,
            act=first.mlp.act,
            cache_dtype=DTYPES[kv_caches[0][0].dtype],
            layers=ctypes.addressof(table),
            final_norm=_ptr(model.model.norm.weight),
            lm_head=_ptr(self.lm_head.packed) if self.lm_head is not None else None,
            vocab=self.lm_head.out_features if self.lm_head is not None else 0,
        )
        self._layers, self._caches = table, kv_caches

    def usable(self, kv_caches, backend) -> bool:
        """The compiled path needs the CPU attention kernel's layout: contiguous caches of
        float32, bfloat16 or float16."""
        if getattr(backend, "name", None) != "cpu":
            return False
        k, v = kv_caches[0]
        return k.dtype in DTYPES and k.is_contiguous() and v.is_contiguous()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        embed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
    ):
        """The final norm [tokens, hidden] of the layer stack over the embeddings of input_ids
        (rows of embed [vocab, hidden]) at `positions`, whose rotary rows are those of the
        cos / sin tables [rows, head_dim] (gpu/models/rope.py Rope.tables).

        With `logits_rows` (int64 row indices; needs self.lm_head), (that, the LM head's
        logits [len(logits_rows), vocab] of those rows) instead."""
        if kv_caches is not self._caches:
            self._bind(kv_caches)
        ids = input_ids.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        x = torch.empty(ids.shape[0], embed.shape[1])
        out = torch.empty_like(x)
        tables = meta.block_tables
        step = _Step(
            tokens=x.shape[0],
            x=x.data_ptr(),
            out=out.data_ptr(),
            input_ids=ids.data_ptr(),
            embed=embed.data_ptr(),
            vocab=embed.shape[0],
            positions=pos.data_ptr(),
            cos_table=cos.data_ptr(),
            sin_table=sin.data_ptr(),
            table_rows=cos.shape[0],
            slots=meta.slot_mapping.data_ptr(),
            block_tables=tables.data_ptr(),
            max_blocks=tables.shape[1],
            query_start=meta.query_start_loc.data_ptr(),
            seq_lens=meta.seq_lens.data_ptr(),
            num_seqs=meta.num_seqs,
            num_threads=torch.get_num_threads(),
        )
        logits = None
        if logits_rows is not None:
            if self.lm_head is None:
                raise ValueError("this model's LM head is not on the compiled path")
            n = logits_rows.shape[0]
            logits = torch.empty(n, self.lm_head.out_features)
            step.num_logits, step.logits = n, logits.data_ptr()
            if n != x.shape[0]:  # the sampled rows only (all rows: 0..n-1, read in place)
                logits_rows = logits_rows.to(torch.int64).contiguous()
                step.logits_rows = logits_rows.data_ptr()
        rc = self._lib.weir_decoder_forward(ctypes.addressof(self._struct), ctypes.addressof(step))
        if rc == 2:
            raise IndexError("token id outside the vocabulary")  # as torch.embedding says
        if rc == 4:
            raise IndexError("a logits row outside the step's tokens")
        if rc != 0:
            raise RuntimeError(f"cpu forward failed ({rc})")
        return out if logits is None else (out, logits)


PROFILE_OPS = ("norm", "qkv", "rope", "kv write", "attention", "o", "gate/up", "down", "lm head")


def profile(enable: bool = True) -> dict[str, float]:
    """Seconds the compiled forward spent per kind of op since the last call (while enabled),
    and zeroed; `enable` switches the timing on or off from here on (benchmarks only)."""
    out = (ctypes.c_double * len(PROFILE_OPS))()
    cpu_build.load().weir_forward_profile(out, int(enable))
    return dict(zip(PROFILE_OPS, out))


def attach(model) -> bool:
    """Give `model` a CpuForward when all of it can run as one call; False (and why, logged)
    when not."""
    reason = unfit(model)
    if reason is not None:
        log.info("CPU forward layer by layer: %s", reason)
        return False
    model.cpu_forward = CpuForward(model)
    return True
