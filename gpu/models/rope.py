"""Rotary position embeddings, with the scaling the config asks for (linear, llama3, yarn, ...)."""

from __future__ import annotations

from typing import Any

import torch

from gpu.models.hunyuan import ntk_alpha_base


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The config's rope settings in one shape: newer configs carry `rope_parameters` (Gemma 3's
    one per layer type: full or sliding attention), older ones `rope_theta` plus an optional
    `rope_scaling` (and Gemma 3's `rope_local_base_freq` for its sliding layers)."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type in params:
        return dict(params[layer_type])
    if params and "rope_theta" in params:
        return dict(params)
    local = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local:
        return {"rope_type": "default", "rope_theta": float(local)}
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    if scaling["rope_type"] == "su":  # the first Phi-3 configs' name for LongRoPE
        scaling["rope_type"] = "longrope"
    scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling


def context_length(config: Any) -> int:
    """The positions the model serves (vLLM's derived max_model_len): max_position_embeddings,
    times the factor of a linear, dynamic or yarn scaling (yarn's from its original length);
    llama3 and longrope configs give the scaled length already."""
    length = int(getattr(config, "max_position_embeddings", None) or 4096)
    params = rope_parameters(config)
    factor = params.get("factor")
    if not factor or params.get("rope_type") in ("default", "llama3", "longrope", "su"):
        return length
    if params.get("rope_type") == "yarn":
        length = int(params.get("original_max_position_embeddings") or length)
    return int(length * float(factor))


class Rope:
    _long: tuple[torch.Tensor, float] | None = None  # LongRoPE's long factors' (inv_freq, scaling)
    _original = 0  # LongRoPE's pretrained length

    def __init__(
        self,
        config: Any,
        head_dim: int,
        device: torch.device,
        factors: torch.Tensor | None = None,
        rotary_dim: int = 0,
        layer_type: str = "full_attention",
    ) -> None:
        """`factors`: per-frequency divisors of the inverse frequencies (a GGUF file's
        rope_freqs tensor, which carries llama3-style scaling). `rotary_dim`: the elements of a
        head rotated, when fewer than all (partial_rope.py: the rest get frequency 0).
        `layer_type`: which of a config's rotations (Gemma 3 turns its sliding layers with
        another)."""
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        stretched = ntk_alpha_base(params, head_dim)  # Hunyuan's NTK alpha: a fixed base
        if rope_type == "default" or stretched is not None:
            dim = rotary_dim or head_dim
            arange = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
            inv_freq = 1.0 / ((stretched or params["rope_theta"]) ** (arange / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            per_type = layer_type in (getattr(config, "rope_parameters", None) or {})
            extra = (None, layer_type) if per_type else ()  # transformers 5's per-type settings
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, *extra)
            if rope_type == "longrope":  # its long factors, for fit_context
                self._original = int(
                    params.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", 0)
                )
                self._long = ROPE_INIT_FUNCTIONS[rope_type](config, device, self._original + 1)
        if factors is not None:
            if factors.numel() != inv_freq.numel():
                raise ValueError(f"rope_freqs: {factors.numel()} factors for {inv_freq.numel()}")
            inv_freq = inv_freq.float().cpu() / factors.float()
        self.head_dim = head_dim
        self.inv_freq = self._padded(inv_freq.float().to(device))
        self.scaling = self._scales(float(scaling))
        # On CPU, cos/sin of positions [0, n) per dtype, grown on demand: a step's rows are
        # looked up instead of computed (six torch ops a step down to two).
        # The table's rows are bitwise what the same arithmetic gives per step (tested).
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def unturned(cls, head_dim: int, device: torch.device) -> Rope:
        """A rotation by the angle 0 at every position (cos 1, sin 0: x as it is, exactly): the
        NoPE layers' (SmolLM3's), through the same path as a second rotation's layers."""
        rope = cls.__new__(cls)
        rope.head_dim = head_dim
        rope.inv_freq = rope._padded(torch.zeros(head_dim // 2, device=device))
        rope.scaling = 1.0
        rope._tables = {}
        return rope

    def fit_context(self, max_model_len: int) -> None:
        """LongRoPE's factors for the context served: the long ones when it passes the
        pretrained length (llama.cpp's choice, by context size), else the short ones. Those
        are transformers' for every sequence of the pretrained length or less, which is all
        this server takes then; transformers switches a longer sequence to the long factors
        per call, vLLM a whole batch when one of its positions is past that length."""
        if self._long is None or max_model_len <= self._original:
            return
        inv_freq, scaling = self._long
        self.inv_freq = self._padded(inv_freq.float().to(self.inv_freq.device))
        self.scaling = self._scales(float(scaling))
        self._tables.clear()

    def _padded(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """A partial rotation's frequencies, zeros for the elements passed through."""
        self._pairs = inv_freq.numel()  # rotated pairs
        rest = self.head_dim // 2 - self._pairs
        return torch.cat([inv_freq, inv_freq.new_zeros(rest)]) if rest > 0 else inv_freq

    def _scales(self, scaling: float) -> float | torch.Tensor:
        """cos and sin's factor: a float, or per element when only some are rotated (the
        elements passed through keep cos 1, sin 0)."""
        if scaling == 1.0 or self._pairs == self.head_dim // 2:
            return scaling
        half = torch.ones(self.head_dim // 2, device=self.inv_freq.device)
        half[: self._pairs] = scaling
        return torch.cat([half, half])

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype):
        # Same arithmetic as transformers (float32 angles, then cast) so logits match closely.
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def tables(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU cos and sin tables [rows, head_dim] of at least positions [0, n)."""
        table = self._tables.get(dtype)
        if table is None or n > table[0].shape[0]:
            size = max(1024, 1 << max(n - 1, 0).bit_length())
            table = self._compute(torch.arange(size, device=self.inv_freq.device), dtype)
            self._tables[dtype] = table
        return table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [tokens, head_dim] for `positions` [tokens]."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self._compute(positions, dtype)  # on a GPU inside CUDA graphs: no host sync
        cos, sin = self.tables(int(positions.max()) + 1, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
