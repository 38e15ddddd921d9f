"""LoRA adapters on the runner's side: read from their folders, kept in host memory (LRU, at most
--max-cpu-loras), and loaded on demand into the slots a step's batched products read.

The slots are static buffers made once per layer and product group (core/lora.py GROUPS: Q/K/V,
O, gate/up, down), in the model's activation dtype on its device (or --lora-dtype's; the
products widen them to the activations' dtype as they read them): per slot and slice (Q, K and V
of the Q/K/V product; gate and up) A [rank, k] as the first rows of a [max_rank, k] block, B^T
[rank, slice columns] with the adapter's scaling folded in, in the slice's columns of the slot's
[max_rank, n] block, zeros elsewhere; and each slice's rank (0: the adapter leaves it alone).
Their addresses never change, so the compiled CPU stack binds them once and a CUDA graph could
read them; a step hands the products a `LoraBatch`, one int32 per token row, its adapter's slot
or -1, with the rows grouped by slot for kernels that tile them adapter by adapter, or, when no
row has an adapter, nothing at all: no LoRA work runs.

Under tensor parallelism each rank keeps its share, sharded as the layer it modifies
(gpu/dist/parallel.py shard): B of the column-parallel products (Q/K/V, gate/up) by output rows,
A of the row-parallel ones (O, down) by input columns; a row-parallel product's delta is then a
partial sum like its base product's, completed by the same all-reduce.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import torch

from core.config import CheckpointError
from gpu.models.partial_rope import for_kernels
from core.lora import (
    FUSED,
    GROUPS,
    PARENT,
    WEIGHTS_FILE,
    LoraBase,
    LoraError,
    LoraRef,
    parse_key,
    read_adapter,
    split_rows,
)

log = logging.getLogger("weir.lora")

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class LoraGroup(NamedTuple):
    """One layer's product group's slots (see the module's docstring)."""

    a: torch.Tensor  # [slots, slices, max_rank, k]
    b: torch.Tensor  # [slots, max_rank, n]
    ranks: torch.Tensor  # [slots, slices] int32
    cols: torch.Tensor  # [slices + 1] int64: each slice's first output column, then n
    cols_list: list[int]


class LoraBatch(NamedTuple):
    """A step's adapters by token row, made on the host and copied in one tensor: each row's
    slot, and for the kernels that take rows adapter by adapter (the CUDA backend's) the rows
    with an adapter grouped by slot, where each slot's run starts and how long it is."""

    rows: torch.Tensor  # [tokens] int32: the row's slot, -1: no adapter
    order: torch.Tensor  # [tokens] int32: slot 0's rows, then slot 1's, ...; the rest unused
    counts: torch.Tensor  # [slots] int32: each slot's rows
    starts: torch.Tensor  # [slots] int32: where they start in `order`

    @staticmethod
    def build(slot_of_row: list[int], slots: int, tensor) -> LoraBatch:
        """From each row's slot (-1: none); `tensor(list, dtype)`: the host-to-device copy."""
        runs: list[list[int]] = [[] for _ in range(slots)]
        for t, s in enumerate(slot_of_row):
            if s >= 0:
                runs[s].append(t)
        order: list[int] = []
        counts, starts = [], []
        for run in runs:
            starts.append(len(order))
            counts.append(len(run))
            order += run
        t = len(slot_of_row)
        order += [0] * (t - len(order))
        packed = tensor(slot_of_row + order + counts + starts, torch.int32)
        return LoraBatch(
            packed[:t], packed[t : 2 * t], packed[2 * t : 2 * t + slots], packed[2 * t + slots :]
        )


class LoraLayer(NamedTuple):
    """What a layer's products take in a step with adapters: the step's rows and the layer's
    groups."""

    batch: LoraBatch
    groups: dict[str, LoraGroup]


def base_of(spec) -> LoraBase:
    """The shapes an adapter must fit, from a gpu/models/spec.py ModelSpec (the whole model's):
    a mixture of experts' layers take adapters on their attention only."""
    return LoraBase.from_dims(
        spec.num_layers,
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.intermediate_size,
        tuple(i for i in range(spec.num_layers) if spec.is_moe_layer(i)),
        not spec.gated_mlp,
    )


class LoraSlots:
    """The adapters a model can run: `max_loras` slots, a host cache of `max_cpu_loras`."""

    def __init__(
        self, model, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: str = "auto"
    ) -> None:
        """`dtype`: --lora-dtype, the slots' dtype (auto: the activations')."""
        if max_loras < 1 or max_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError("--max-loras and --max-lora-rank >= 1, --max-cpu-loras >= --max-loras")
        self.model = model
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.base = base_of(model.spec)
        spec = model.local_spec
        weight = model.model.norm.weight
        self.device, self.dtype = weight.device, weight.dtype
        if dtype != "auto":
            self.dtype = getattr(torch, dtype)
            if self.device.type == "cpu" and self.dtype == torch.float16:
                raise CheckpointError(
                    "--lora-dtype float16: the CPU kernels hold adapters in float32 or bfloat16"
                )
        h, i = spec.hidden_size, spec.intermediate_size
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        shapes = {  # group -> (inputs, each slice's outputs)
            "qkv": (h, [q, kv, kv]),
            "o": (q, [h]),
            "gate_up": (h, [i, i]),
            "down": (i, [h]),
        }
        s, r = max_loras, max_rank
        self.layers: list[dict[str, LoraGroup]] = []
        for index in range(spec.num_layers):
            groups = {}
            for name, (k, widths) in shapes.items():
                if name in ("gate_up", "down") and index in self.base.sparse_layers:
                    continue  # a mixture of experts' MLP takes no adapter (core/lora.py)
                cols = [0]
                for w in widths:
                    cols.append(cols[-1] + w)
                groups[name] = LoraGroup(
                    torch.zeros(s, len(widths), r, k, dtype=self.dtype, device=self.device),
                    torch.zeros(s, r, cols[-1], dtype=self.dtype, device=self.device),
                    torch.zeros(s, len(widths), dtype=torch.int32, device=self.device),
                    torch.tensor(cols, dtype=torch.int64, device=self.device),
                    cols,
                )
            self.layers.append(groups)
        self.keys: list[int | None] = [None] * s  # each slot's adapter (its content key)
        self._used = [0] * s  # the step each slot last served
        self._steps = 0
        self.host: OrderedDict[int, dict] = OrderedDict()  # key -> weights, least recent first
        self.num_loads = 0  # adapters read from their folders
        self.num_slot_loads = 0  # adapters copied into a slot

    # ---- a step ----
    def batch(self, refs: list[LoraRef | None], counts: list[int], tensor) -> LoraBatch | None:
        """The step's slot per token row (request i has counts[i] rows), its adapters loaded
        into slots first; None when no request has one. `tensor(list, dtype)`: the runner's
        host-to-device copy."""
        keys = {ref.key: ref for ref in refs if ref is not None}
        if not keys:
            return None
        if len(keys) > self.max_loras:
            raise RuntimeError(
                f"{len(keys)} adapters in one step, more than --max-loras {self.max_loras}"
            )
        self._steps += 1
        slot_of = {}
        for key, ref in keys.items():
            slot_of[key] = self._slot(ref, keys)
            self._used[slot_of[key]] = self._steps
        flat: list[int] = []
        for ref, n in zip(refs, counts):
            flat += [slot_of[ref.key] if ref is not None else -1] * n
        return LoraBatch.build(flat, self.max_loras, tensor)

    def _slot(self, ref: LoraRef, wanted: dict) -> int:
        """A slot holding `ref`'s adapter: its own, a free one, or the least recently used one
        no adapter of this step holds (an adapter in use is never evicted)."""
        if ref.key in self.keys:
            return self.keys.index(ref.key)
        free = [i for i, k in enumerate(self.keys) if k is None or k not in wanted]
        slot = min(free, key=lambda i: (self.keys[i] is not None, self._used[i]))
        self._load_slot(slot, self._weights(ref))
        self.keys[slot] = ref.key
        return slot

    def _load_slot(self, slot: int, weights: dict) -> None:
        for li, groups in enumerate(self.layers):
            for name, g in groups.items():
                g.a[slot].zero_()
                g.b[slot].zero_()
                ranks = []
                for si, module in enumerate(GROUPS[name]):
                    w = weights.get((li, module))
                    if w is None:
                        ranks.append(0)
                        continue
                    a, bt = w
                    r = a.shape[0]
                    g.a[slot, si, :r].copy_(a)
                    g.b[slot, :r, g.cols_list[si] : g.cols_list[si + 1]].copy_(bt)
                    ranks.append(r)
                g.ranks[slot].copy_(torch.tensor(ranks, dtype=torch.int32))
        self.num_slot_loads += 1

    # ---- host memory ----
    def preload(self, ref: LoraRef) -> None:
        """Read the adapter into host memory if it is not there (LoraError if it cannot be)."""
        self._weights(ref)

    def _weights(self, ref: LoraRef) -> dict:
        """The adapter's weights in host memory (read on first use; least recently used
        dropped past --max-cpu-loras)."""
        got = self.host.get(ref.key)
        if got is not None:
            self.host.move_to_end(ref.key)
            return got
        got = self.read(ref)
        self.host[ref.key] = got
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return got

    def read(self, ref: LoraRef) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """(layer, module) -> (A [r, in], B^T * scaling [r, out]), this rank's share, in the
        model's dtype; checked against the base model as the server checks it."""
        from safetensors.torch import load_file

        info = read_adapter(ref.name, ref.path, self.base, self.max_rank)
        if info.ref.key != ref.key:
            raise LoraError(
                f"LoRA adapter {ref.name!r}: the files in {ref.path} changed since it was "
                "loaded; load it again"
            )
        tp, spec = self.model.tp, self.model.spec
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        try:
            tensors = load_file(str(Path(ref.path) / WEIGHTS_FILE))
        except Exception as e:  # noqa: BLE001 - a file changed under us fails its requests only
            raise LoraError(f"LoRA adapter {ref.name!r}: {WEIGHTS_FILE} unreadable: {e}") from None
        for key, whole in tensors.items():
            layer, fused, ab = parse_key(key)
            if fused in FUSED:  # one A for the parts, B's rows split among them
                parts = [(m, whole if ab == "A" else whole[a:b]) for m, a, b in split_rows(
                    self.base, fused
                )]  # fmt: skip
            else:
                parts = [(fused, whole)]
            for module, t in parts:
                name = f"model.layers.{layer}.{PARENT[module]}.{module}.weight"
                if ab == "B":  # Q/K rows as the base's were reordered (a partial rotation)
                    t = for_kernels(spec, name, t)
                if tp is not None:
                    from gpu.dist.parallel import shard

                    if (ab == "B") == (module in COLUMN_PARALLEL):
                        t = shard(name, t, spec, tp)
                pairs.setdefault((layer, module), {})[ab] = t
        out = {}
        for where, p in pairs.items():
            a = p["A"].float()
            bt = (p["B"].float() * info.scaling).t()
            out[where] = (
                a.to(self.dtype).contiguous(),
                bt.to(self.dtype).contiguous(),
            )
        self.num_loads += 1
        log.info("LoRA adapter %s read from %s (rank %d)", ref.name, ref.path, info.rank)
        return out

    def layer(self, i: int, batch: LoraBatch) -> LoraLayer:
        return LoraLayer(batch, self.layers[i])

    def stack_tensors(self) -> list[list[torch.Tensor]]:
        """Per layer, [a, b, ranks, cols] of each group in the compiled stack's order."""
        order = ("qkv", "o", "gate_up", "down")
        none = [torch.empty(0, device=self.device)] * 4  # a group no adapter can modify
        return [
            [t for g in order for t in (layer[g][:4] if g in layer else none)]
            for layer in self.layers
        ]


def lora_add_reference(
    y: torch.Tensor, x: torch.Tensor, g: LoraGroup, rows: torch.Tensor
) -> torch.Tensor:
    """y[t, slice columns] += (x[t] A^T) B^T for each row's adapter, in torch (the reference
    every backend's kernel is held to), in x's dtype (slots of another --lora-dtype widened or
    narrowed to it); rows with slot -1 untouched."""
    idx = (rows >= 0).nonzero().squeeze(1)
    if idx.numel() == 0:
        return y
    slots = rows[idx].long()
    xs = x[idx]
    for si in range(g.a.shape[1]):
        c0, c1 = g.cols_list[si], g.cols_list[si + 1]
        v = torch.bmm(g.a[slots, si].to(x.dtype), xs[:, :, None])  # [m, R, 1]
        d = torch.bmm(g.b[slots, :, c0:c1].transpose(1, 2).to(x.dtype), v)[..., 0]  # [m, cols]
        y[idx, c0:c1] += d.to(y.dtype)
    return y
