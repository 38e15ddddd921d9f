"""Tensor parallelism: one rank's place in the group, its share of the model, and the collectives.

Megatron-style sharding of the decoder (gpu/models/decoder.py) over `world_size` ranks joined by
`torch.distributed` (gloo on CPU, NCCL on CUDA):

- Q/K/V and gate/up are column-parallel: each rank holds its heads' rows (num_heads / world
  query heads, and num_kv_heads / world KV heads, or one replicated KV head when there are
  fewer KV heads than ranks) and intermediate / world MLP rows (each expert's too, in a mixture
  of experts, whose router is replicated). A rank's attention and MLP
  activation then need nothing from the others.
- O and down are row-parallel: each rank holds the matching input columns and produces a partial
  sum; one all-reduce per product adds them (the residual and any bias are added by rank 0
  only, so they are counted once).
- The embedding and the LM head are vocabulary-parallel: each rank holds ceil(vocab / world)
  rows (the last padded with zeros). A lookup outside a rank's rows gives zeros there, and an
  all-reduce assembles the embedding; the logits are all-gathered along the vocabulary.
- Norms (and Qwen3's per-head Q/K norms) are small and replicated; gpt-oss's sinks (one a query
  head) split with their heads, its router and the router's bias replicated, each expert's
  gate/up biases split with their rows and down's bias kept by rank 0 (added once, after the
  all-reduce's sum). An MXFP4 or block-format expert (gpu/quant/tensor.py BlockTensor) is split
  by whole rows and, for down, by whole blocks of its columns.

The model's modules are built with the per-rank shapes (`local_spec`), so the decoder's code is the
same at every world size; weights load shard by shard (`shard`), no rank reading a whole tensor it
does not keep (safetensors slices).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.models.spec import ModelSpec
from gpu.quant.fp8 import Fp8Tensor
from gpu.quant.tensor import BlockTensor


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (same shape on every rank)."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def check(spec: ModelSpec, world_size: int) -> None:
    """Raise CheckpointError (the model given cannot be served so: exit code 2) when the
    model's shapes do not split over `world_size` ranks."""
    if world_size < 1:
        raise ValueError("--tensor-parallel-size must be at least 1")
    if world_size == 1:
        return
    if spec.qk_norm_whole:  # OLMo's norm of all heads at once: no rank holds them all
        raise CheckpointError(
            f"{spec.architecture} under tensor parallelism is not served: its Q/K norms span "
            "every head"
        )
    if spec.head_bias:  # (Phi-2's: its rows would split with the vocabulary's)
        raise CheckpointError(
            f"{spec.architecture} under tensor parallelism is not served: its LM head has a bias"
        )
    problems = []
    if spec.num_heads % world_size:
        problems.append(f"{spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv % world_size and world_size % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of the ranks)")
    if spec.intermediate_size % world_size:
        problems.append(f"an MLP of {spec.intermediate_size}")
    if spec.moe_intermediate_size % world_size:
        problems.append(f"experts of {spec.moe_intermediate_size}")
    if spec.shared_expert_size % world_size:
        problems.append(f"a shared expert of {spec.shared_expert_size}")
    if problems:
        raise CheckpointError(
            f"--tensor-parallel-size {world_size} does not divide this model: "
            + ", ".join(problems)
        )


def vocab_shard(spec: ModelSpec, world_size: int) -> int:
    """Rows of the embedding and LM head each rank holds (the last rank's padded with zeros)."""
    return -(-spec.vocab_size // world_size)


def local_spec(spec: ModelSpec, tp: TensorParallel) -> ModelSpec:
    """The shapes of one rank's modules."""
    check(spec, tp.world_size)
    w = tp.world_size
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // w,
        num_kv_heads=max(1, spec.num_kv_heads // w),
        intermediate_size=spec.intermediate_size // w,
        moe_intermediate_size=spec.moe_intermediate_size // w,
        shared_expert_size=spec.shared_expert_size // w,
        vocab_size=vocab_shard(spec, w),
    )


def kv_head_range(spec: ModelSpec, tp: TensorParallel) -> tuple[int, int]:
    """The checkpoint's KV heads [first, first + count) this rank keeps: its own share, or the
    one KV head its query heads read when KV heads are replicated."""
    kv, w = spec.num_kv_heads, tp.world_size
    if kv >= w:
        return tp.rank * (kv // w), kv // w
    return tp.rank * kv // w, 1


# Checkpoint names -> how the tensor splits: ("rows" | "cols", kind); anything not listed (norms,
# Q/K norm weights) is replicated.
_SPLITS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "self_attn.o_proj": "o",
    "self_attn.sinks": "heads",
    "mlp.gate_proj": "mlp",
    "mlp.up_proj": "mlp",
    "mlp.down_proj": "down",
    "embed_tokens": "vocab",
    "lm_head": "vocab",
}


def shard(name: str, full: Any, spec: ModelSpec, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`; `full` is a safetensors slice (or a tensor)
    indexed without reading the rest."""
    shape = tuple(full.get_shape()) if hasattr(full, "get_shape") else tuple(full.shape)
    kind = next((k for key, k in _SPLITS.items() if f"{key}." in name + "."), None)
    if ".mlp.experts." in name:  # each expert split as an MLP (its router is replicated)
        kind = "down" if ".down_proj." in name else "expert"
    elif ".mlp.shared_expert." in name:  # so is a shared expert (its gate is replicated)
        kind = "down" if name.endswith(".down_proj.weight") else "shared"
    if kind is None or tp.world_size == 1:  # (a scalar, Apertus's xIELU beta: [...], not [:])
        return full[...] if hasattr(full, "get_shape") else full
    w, r = tp.world_size, tp.rank
    if isinstance(full, Fp8Tensor):  # FP8 weights: their rows' scales go with the rows
        return _shard_fp8(full, kind, spec, tp)
    if kind in ("o", "down"):  # row-parallel: columns
        if isinstance(full, BlockTensor):  # whole blocks (CheckpointError where one is cut)
            return full.take_cols(r * (shape[1] // w), (r + 1) * (shape[1] // w), name)
        if not name.endswith(".weight"):  # a bias is added once: rank 0 keeps it, the rest zeros
            return full[:] if r == 0 else torch.zeros(shape, dtype=full[:1].dtype)
        n = shape[1] // w
        return full[:, r * n : (r + 1) * n]
    first, count = _rows(kind, spec, tp)
    lo, hi = min(first, shape[0]), min(first + count, shape[0])  # the vocabulary's last share
    if isinstance(full, BlockTensor):  # whole rows of blocks; zero bytes read as zeros
        part = full.take_rows(np.arange(lo, hi))
        if hi - lo < count:
            pad = np.zeros((count - (hi - lo), full.rows.shape[1]), np.uint8)
            part = BlockTensor(np.concatenate([part.rows, pad]), full.fmt, (count, shape[1]))
        return part
    part = full[lo:hi]
    if hi - lo < count:  # padded with zeros
        pad = torch.zeros((count - (hi - lo), *shape[1:]), dtype=part.dtype)
        part = torch.cat([part, pad])
    return part


def _shard_fp8(full: Fp8Tensor, kind: str, spec: ModelSpec, tp: TensorParallel) -> Fp8Tensor:
    """An FP8 weight's share: columns with every row's scale (row-parallel), or rows with their
    own scales (padded with zero rows of scale 1, as a float tensor is padded with zeros)."""
    n, k = full.shape
    if kind in ("o", "down"):
        cols = k // tp.world_size
        part = full.weight[:, tp.rank * cols : (tp.rank + 1) * cols].contiguous()
        return Fp8Tensor(part, full.scale, full.input_scale)
    first, count = _rows(kind, spec, tp)
    lo, hi = min(first, n), min(first + count, n)
    weight, scale = full.weight[lo:hi], full.scale[lo:hi]
    if hi - lo < count:
        pad = count - (hi - lo)
        weight = torch.cat([weight, torch.zeros((pad, k), dtype=weight.dtype)])
        scale = torch.cat([scale, torch.ones(pad, dtype=scale.dtype)])
    return Fp8Tensor(weight.contiguous(), scale.contiguous(), full.input_scale)


def _rows(kind: str, spec: ModelSpec, tp: TensorParallel) -> tuple[int, int]:
    """(first, count): the rows of a column-parallel tensor this rank keeps, whatever holds it
    (a float tensor, or a block format's rows: a GGUF file's, gpt-oss's MXFP4 experts)."""
    w, r, d = tp.world_size, tp.rank, spec.head_dim
    if kind == "q":
        return r * (spec.num_heads // w) * d, spec.num_heads // w * d
    if kind == "heads":
        return r * (spec.num_heads // w), spec.num_heads // w
    if kind == "kv":
        first, count = kv_head_range(spec, tp)
        return first * d, count * d
    if kind in ("mlp", "expert", "shared"):
        sizes = {"mlp": spec.intermediate_size, "expert": spec.moe_intermediate_size}
        n = sizes.get(kind, spec.shared_expert_size) // w
        return r * n, n
    n = vocab_shard(spec, w)  # vocab: the last rank's tail past the vocabulary
    return r * n, n


def init(rank: int, world_size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join the process group (NCCL on CUDA, gloo on CPU) as `rank` of `world_size`."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TensorParallel(rank, world_size)
