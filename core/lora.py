"""LoRA adapters as PEFT saves them, read and checked without torch: what a request names, what
the engine and the runner know of an adapter, and why one is refused.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (each tensor
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`, A [r, in] and B
[out, r]). `read_adapter` checks its config and its tensors' shapes (the safetensors header is
JSON: no tensor is read) against the base model (`LoraBase`), and names the adapter by its
content: `LoraRef.key` is a digest of its files, so prefix caching and the runner's slots keep
two adapters apart even when they share a name (an adapter reloaded under its old name with
other weights never reuses the old KV blocks), and the same files under two names share them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import msgspec

# Projections an adapter may modify (PEFT's target module names), by the group of the decoder's
# products that holds them: Q/K/V one product, gate/up one, O and down one each.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGETS = tuple(m for mods in GROUPS.values() for m in mods)
# Modules a checkpoint holds as one (Phi-3's, gpu/fused_weights.py): an adapter of one has a
# single A for its parts and B stacked by output rows in the parts' order, read as each part's
# own (A, its rows of B), which computes the same delta.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
PARENT = {m: "self_attn" if g in ("qkv", "o") else "mlp" for g, ms in GROUPS.items() for m in ms}
PARENT |= {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
ALL_TARGETS = (*TARGETS, *FUSED)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(ValueError):
    """An adapter that cannot be served: the message names it and what is wrong; `param` the
    load request's field at fault (its files, unless its name)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


class LoRARequest(msgspec.Struct, frozen=True, gc=False):
    """vLLM's `LoRARequest`: an adapter by name, id and folder (offline `LLM.generate`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


class LoraRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An adapter as a request carries it to the engine and the runner: its name, its content
    key (a digest of its files: the identity prefix caching and the slots go by), its folder."""

    name: str
    key: int
    path: str


class LoraBase(msgspec.Struct, frozen=True, gc=False):
    """The base model's shapes an adapter must fit: per target module (in, out); `sparse_layers`:
    the layers whose MLP is a mixture of experts (an adapter modifies their attention only);
    `ungated_mlp`: every layer's MLP is ungated (Arcee's: adapters on attention only)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    sparse_layers: tuple[int, ...] = ()
    ungated_mlp: bool = False

    @classmethod
    def from_dims(
        cls,
        num_layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        sparse_layers: tuple[int, ...] = (),
        ungated_mlp: bool = False,
    ) -> LoraBase:
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls(
            num_layers,
            {
                "q_proj": (hidden, q),
                "k_proj": (hidden, kv),
                "v_proj": (hidden, kv),
                "o_proj": (q, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            },
            tuple(sparse_layers),
            ungated_mlp,
        )


class AdapterInfo(msgspec.Struct, frozen=True, gc=False):
    """A checked adapter: its ref, rank, scaling and the modules it modifies."""

    ref: LoraRef
    rank: int
    scaling: float
    targets: tuple[str, ...]


_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets), each
    tensor's bytes checked to lie whole in the file (a truncated copy is refused here, at load,
    not when a request first reads it)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise LoraError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise LoraError(f"{path}: not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise LoraError(f"{path}: not a safetensors file") from None
        data = os.fstat(f.fileno()).st_size - 8 - n
    if not isinstance(header, dict):
        raise LoraError(f"{path}: not a safetensors file")
    header.pop("__metadata__", None)
    for name, t in header.items():
        try:
            begin, end = (int(v) for v in t["data_offsets"])
            count = math.prod(int(d) for d in t["shape"])
        except (TypeError, KeyError, ValueError):
            raise LoraError(f"{path}: tensor {name}: a malformed header entry") from None
        size = _ITEM_BYTES.get(t.get("dtype"))
        if not 0 <= begin <= end <= data or (size is not None and end - begin != count * size):
            raise LoraError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
    return header


def parse_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" or "B") of a PEFT tensor name, or None for anything else."""
    parts = key.split(".")
    # ...model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight (an adapter name may sit
    # before `weight` in files saved with one)
    try:
        at = parts.index("layers")
        layer = int(parts[at + 1])
        parent, module, ab = parts[at + 2], parts[at + 3], parts[at + 4]
    except (ValueError, IndexError):
        return None
    if ab not in ("lora_A", "lora_B") or PARENT.get(module) != parent or parts[-1] != "weight":
        return None
    return layer, module, ab[-1]


def _targets(config: dict, name: str) -> set[str] | None:
    targets = config.get("target_modules")
    if targets == "all-linear":
        return set(ALL_TARGETS)
    if isinstance(targets, str):
        return None  # a regex: the tensors themselves say which modules it modifies
    if not isinstance(targets, list) or not targets:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json has no target_modules")
    targets = {t.rsplit(".", 1)[-1] for t in targets}
    other = sorted(targets - set(ALL_TARGETS))
    if other:
        raise LoraError(
            f"LoRA adapter {name!r} targets {', '.join(other)}: weir's adapters modify "
            f"{', '.join(ALL_TARGETS)}"
        )
    return targets


def read_adapter(name: str, path: str | Path, base: LoraBase, max_rank: int) -> AdapterInfo:
    """Check the adapter in folder `path` against the base model and --max-lora-rank; its
    content key is a digest of its two files. Raises LoraError naming the adapter."""
    folder = Path(path).expanduser()
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise LoraError(
            f"LoRA adapter {name!r}: {folder} needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(a PEFT adapter as save_pretrained writes it)"
        )
    raw_config = config_file.read_bytes()
    try:
        config = json.loads(raw_config)
    except ValueError as e:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON ({e})") from None
    refuse = _refusal(config)
    if refuse:
        raise LoraError(f"LoRA adapter {name!r}: {refuse}")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json has no rank r")
    if r > max_rank:
        raise LoraError(f"LoRA adapter {name!r} has rank {r}, more than --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    targets = _targets(config, name)
    for extra in ("added_tokens.json", "new_embeddings.safetensors"):
        if (folder / extra).exists():
            raise LoraError(
                f"LoRA adapter {name!r} adds tokens ({extra}): weir serves adapters that keep "
                "the base model's vocabulary"
            )
    try:
        header = safetensors_header(weights_file)
    except LoraError as e:
        raise LoraError(f"LoRA adapter {name!r}: {e}") from None
    seen = _check_tensors(name, header, base, r, targets)
    digest = hashlib.sha256(raw_config)
    with open(weights_file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    key = int.from_bytes(digest.digest()[:8], "little") >> 1  # a positive int64
    return AdapterInfo(LoraRef(name, key, str(folder)), r, float(scaling), tuple(sorted(seen)))


def _refusal(config: dict) -> str | None:
    """What in an adapter_config.json weir does not serve, or None."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {config['peft_type']}: weir serves LoRA adapters"
    if config.get("use_dora"):
        return "uses DoRA (use_dora), which weir does not serve"
    if config.get("modules_to_save"):
        return (
            f"uses modules_to_save ({', '.join(config['modules_to_save'])}): weir serves "
            "adapters that modify projections only"
        )
    if config.get("bias", "none") != "none":
        return f"bias {config['bias']!r}: weir serves adapters with bias none"
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            return f"uses {key}: weir serves one rank and alpha per adapter"
    if config.get("layers_to_transform") is not None:
        return "uses layers_to_transform: weir serves adapters over every layer's tensors"
    if config.get("fan_in_fan_out"):
        return "uses fan_in_fan_out (Conv1D weights), which weir's models do not have"
    return None


def _check_tensors(
    name: str, header: dict, base: LoraBase, r: int, targets: set[str] | None
) -> set[str]:
    seen: set[str] = set()
    pairs: dict[tuple[int, str], set[str]] = {}
    for key, meta in header.items():
        parsed = parse_key(key)
        mixture = (".experts.", ".shared_expert", ".mlp.gate.")
        if parsed is None and any(part in key for part in mixture):
            raise LoraError(
                f"LoRA adapter {name!r} modifies a mixture of experts ({key}): weir serves "
                "adapters on such a model's attention and dense MLPs, not on its experts or router"
            )
        if parsed is None:
            what = "embeddings" if "embed_tokens" in key or "lm_head" in key else "a tensor"
            raise LoraError(
                f"LoRA adapter {name!r} has {what} weir does not serve: {key} (weir serves "
                f"lora_A/lora_B of {', '.join(ALL_TARGETS)})"
            )
        layer, module, ab = parsed
        if targets is not None and module not in targets:
            raise LoraError(f"LoRA adapter {name!r}: {key} is not among its target_modules")
        if layer >= base.num_layers:
            raise LoraError(
                f"LoRA adapter {name!r}: {key} is for layer {layer}, the base model has "
                f"{base.num_layers}"
            )
        if PARENT[module] == "mlp" and layer in base.sparse_layers:
            raise LoraError(
                f"LoRA adapter {name!r}: {key} modifies layer {layer}'s MLP, a mixture of "
                "experts there: weir serves adapters on its attention only"
            )
        if PARENT[module] == "mlp" and base.ungated_mlp:
            raise LoraError(
                f"LoRA adapter {name!r}: {key} modifies an ungated MLP (up and down, no gate: "
                "Arcee's): weir serves adapters on its attention only"
            )
        if meta.get("dtype") not in ("F32", "F16", "BF16"):
            raise LoraError(f"LoRA adapter {name!r}: {key} is {meta.get('dtype')}")
        n_in, n_out = fused_shape(base, module)
        want = [r, n_in] if ab == "A" else [n_out, r]
        if list(meta.get("shape", ())) != want:
            raise LoraError(
                f"LoRA adapter {name!r} does not fit the base model: {key} is "
                f"{meta.get('shape')}, the base model needs {want}"
            )
        pairs.setdefault((layer, module), set()).add(ab)
        seen.update(FUSED.get(module, (module,)))
    for (layer, module), got in pairs.items():
        if got != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_B or lora_A")
        both = [p for p in FUSED.get(module, ()) if (layer, p) in pairs]
        if both:
            raise LoraError(
                f"LoRA adapter {name!r}: layer {layer} has {module} and {both[0]}, a part of it"
            )
    if not seen:
        raise LoraError(f"LoRA adapter {name!r} has no LoRA tensors")
    return seen


def fused_shape(base: LoraBase, module: str) -> tuple[int, int]:
    """(in, out) of a module an adapter may modify: a fused one's out is its parts' together."""
    if module not in FUSED:
        return base.shapes[module]
    parts = [base.shapes[p] for p in FUSED[module]]
    return parts[0][0], sum(out for _, out in parts)


def split_rows(base: LoraBase, module: str) -> list[tuple[str, int, int]]:
    """A fused module's parts with the rows [begin, end) of its B each takes."""
    out, at = [], 0
    for part in FUSED[module]:
        rows = base.shapes[part][1]
        out.append((part, at, at + rows))
        at += rows
    return out


def parse_lora_modules(values: list[str]) -> list[tuple[str, str, str | None]]:
    """--lora-modules as vLLM takes them: `name=path`, or JSON `{"name", "path",
    "base_model_name"}`; (name, path, base_model_name) each."""
    out = []
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            try:
                data = json.loads(value)
                out.append((data["name"], data["path"], data.get("base_model_name")))
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f'--lora-modules {value}: the JSON form needs "name" and "path"'
                ) from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value}: give name=path or a JSON object")
        out.append((name, path, None))
    return out
