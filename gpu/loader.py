"""Model loading: a local directory, a hub id or a GGUF file; config via AutoConfig (or the GGUF
metadata, gpu/gguf_file.py), weights via safetensors (or the GGUF file's memory map).

Each weight goes to its module as the checkpoint holds it: a tensor in the checkpoint's dtype, or
a BlockTensor of a GGUF file (or of an AWQ, GPTQ or compressed-tensors layer, repacked:
gpu/quant/int4.py, gpu/quant/compressed.py); the backend puts it in its own form when the model
is prepared."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from core.config import CheckpointError
from gpu import hf_overrides, kv_scales
from gpu.fused_weights import fused_parts, split_fused
from gpu.gguf_file import GgufCheckpoint, is_gguf
from gpu.hf_overrides import ScoreRows
from gpu.models import gpt_oss, renames
from gpu.models.decoder import DecoderForCausalLM
from gpu.models.moe import STACKED, checkpoint_name, cut_stacked
from gpu.models.partial_rope import for_kernels
from gpu.models.rope import Rope
from gpu.models.spec import ModelSpec
from gpu.quant.compressed import CompressedScheme
from gpu.quant.fp8 import Fp8Scheme
from gpu.quant.int4 import Int4Scheme
from gpu.text_of import TEXT_OF, text_config, text_name
from gpu.dist.parallel import TensorParallel, shard

log = logging.getLogger("weir.loader")

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory or .gguf file as is; anything else is a hub id fetched with
    huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists():
        raise CheckpointError(f"model path {model!r} is not a directory or a .gguf file")
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or path.suffix == ".gguf":
        what = "model file" if path.suffix.lower() == ".gguf" else "model directory"
        raise CheckpointError(f"{what} {model!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            model,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:  # noqa: BLE001 - re-raised with what the user needs to know
        raise CheckpointError(
            f"could not find model {model!r}: not a local directory, and the hub download "
            f"failed ({type(e).__name__}: {e})"
        ) from e
    return Path(local)


def load_config(
    path: Path, overrides: dict[str, Any] | None = None, tokenizer: str | None = None
) -> Any:
    """The checkpoint's config (a multimodal one's text model), with --hf-overrides set over it
    (gpu/hf_overrides.py; `tokenizer`: --tokenizer, for its tokens)."""
    if is_gguf(path):
        if overrides:
            raise CheckpointError("--hf-overrides: a GGUF file's config is not overridden")
        return GgufCheckpoint(path).config()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        config = _remote_config(path)
        if config is None:
            raise CheckpointError(f"{path}: no readable config.json ({e})") from None
    config = hf_overrides.apply(config, overrides, Path(tokenizer) if tokenizer else path)
    multimodal = any(a in TEXT_OF for a in getattr(config, "architectures", None) or [])
    return text_config(config, _has_head(path) if multimodal else None)


def _has_head(path: Path) -> bool | None:
    """Whether the checkpoint's weights hold an LM head (from their files' headers; None where
    there are none to read)."""
    try:
        files = weight_files(Path(path))
    except (OSError, ValueError):
        return None
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if any(n.endswith("lm_head.weight") for n in f.keys()):
                return True
    return False


def _remote_config(path: Path) -> Any:
    """The config of a model whose config class lives in its hub's remote code, for the types
    weir reads itself (gpu/models/encoder_spec.py REMOTE_TYPES: GTE's); else None."""
    from gpu.models.remote_encoder_spec import REMOTE_TYPES, remote_config

    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return remote_config(raw) if raw.get("model_type") in REMOTE_TYPES else None


def resolve_dtype(dtype: str, config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return DTYPES[dtype]
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = DTYPES.get(cfg)
    if cfg not in (torch.float32, torch.bfloat16, torch.float16):
        cfg = torch.float32
    if device.type == "cpu" and cfg == torch.float16:
        return torch.bfloat16  # half matmuls are slow or missing on CPU
    return cfg


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    return files


class Targets:
    """Where each checkpoint tensor goes: a module that loads tensors as they come (Linear,
    Embedding: `expects`, `load`) or a parameter of the model's own dtype (norms)."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules: dict[str, tuple[Any, str, tuple[int, ...]]] = {}
        for name, mod in model.named_modules():
            if hasattr(mod, "expects"):
                for kind, shape in mod.expects().items():
                    self.modules[f"{name}.{kind}"] = (mod, kind, shape)
        self.loaded: set[str] = set()

    def wants(self, name: str) -> bool:
        if name in self.params or name in self.modules:
            return True
        if name == "lm_head.weight" and self.model.spec.tie_word_embeddings:
            return False
        if name.endswith("rotary_emb.inv_freq"):
            return False
        raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")

    def place(self, name: str, value: Any) -> None:
        spec = self.model.spec
        # A partial or interleaved rotation (gpu/models/partial_rope.py). (An encoder's spec,
        # gpu/models/encoder_spec.py, has no rotation and no Gemma norms.)
        value = for_kernels(spec, name, value)
        shape = tuple(value.shape)
        if name in self.modules:
            mod, kind, want = self.modules[name]
            if shape != want:
                raise CheckpointError(f"weight {name!r} has shape {shape}, model expects {want}")
            mod.load(kind, value)
        else:
            target = self.params[name]
            if getattr(spec, "norm_plus_one", False) and name.endswith("norm.weight"):
                value = value.float() + 1.0  # Gemma's norms multiply by 1 + w
            if shape != tuple(target.shape):
                raise CheckpointError(
                    f"weight {name!r} has shape {shape}, model expects {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(value)
        self.loaded.add(name)

    def check_complete(self) -> None:
        missing = (set(self.params) | set(self.modules)) - self.loaded
        if missing:
            raise CheckpointError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")


def int4_scheme(path: Path, config: Any) -> Int4Scheme | Fp8Scheme | CompressedScheme | None:
    """The quantization scheme of a checkpoint whose config.json has a quantization_config:
    AWQ / GPTQ (gpu/quant/int4.py), FP8 (gpu/quant/fp8.py; ModelOpt's too, from its
    hf_quant_config.json) or compressed-tensors (gpu/quant/compressed.py); gpt-oss's MXFP4
    experts need none (dequantized as read); any other is refused. Each says which checkpoint
    tensors are parts of a quantized layer (`gathers`), when a layer's parts are all read
    (`complete`) and makes its weight (`make`)."""
    if is_gguf(path):
        return None
    qc = getattr(config, "quantization_config", None)
    modelopt = path / "hf_quant_config.json"  # ModelOpt's own file (vLLM reads it first)
    if modelopt.exists():
        try:
            qc = {"quant_method": "modelopt", **json.loads(modelopt.read_text())["quantization"]}
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{modelopt}: no readable 'quantization' entry ({e})") from None
    if not qc:
        return None
    method = str(dict(qc).get("quant_method", "")).lower()
    if method == "modelopt":
        return Fp8Scheme.from_modelopt(dict(qc), str(path))
    if method == "fp8":
        return Fp8Scheme.from_config(dict(qc), str(path))
    if method == "compressed-tensors":
        return CompressedScheme.from_config(dict(qc), str(path))
    if method == "mxfp4":  # gpt-oss's experts: dequantized as they are read (gpu/models/gpt_oss.py)
        return None
    return Int4Scheme.from_config(dict(qc), str(path))


def _dtype(f, name: str) -> str:
    """A safetensors entry's dtype as the file names it (F8_E4M3, BF16, ...), from its header."""
    return f.get_slice(name).get_dtype()


def load_weights(model: DecoderForCausalLM, path: Path, int4=None, text_only: bool = False) -> None:
    """Every weight from the checkpoint by name; under tensor parallelism only this rank's part
    of each tensor is read (a safetensors slice, gpu/dist/parallel.py `shard`). A quantized
    layer's parts (int4: qweight, qzeros, scales, g_idx; FP8: the weight, its weight_scale and
    input_scale; compressed-tensors: gpu/quant/compressed.py) are gathered whole, made into one
    weight and then cut to this rank's share (block formats by whole rows and blocks).
    `text_only`: a multimodal checkpoint's text model (gpu/text_of.py)."""
    targets = Targets(model)
    tp = model.tp
    pending: dict[str, dict[str, torch.Tensor]] = {}
    experts = gpt_oss.Experts()
    spec = model.spec
    score = ScoreRows(spec.score_token_ids, spec.score_difference) if spec.score_token_ids else None
    files = weight_files(path)
    with tqdm(
        total=len(targets.params) + len(targets.modules),
        desc="Loading weights",
        unit="tensor",
        leave=False,
    ) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored in f.keys():
                    name = text_name(stored) if text_only else stored
                    if name is None:
                        continue  # a multimodal checkpoint's other towers (gpu/text_of.py)
                    name = checkpoint_name(name)  # Mixtral's experts (gpu/models/moe.py)
                    name = renames.checkpoint_name(spec.architecture, name)  # (GLM-4's, ...)
                    if score is not None and name in ScoreRows.NAMES:
                        score.take(name, f.get_tensor(stored))
                        if name == "lm_head.weight":
                            continue  # the LM head: only its rows, the classifier's head
                    if kv_scales.which(name) is not None:  # a layer's FP8 KV cache scale
                        kv_scales.place(model, name, f.get_tensor(stored))
                        continue
                    prefix, _, part = name.rpartition(".")
                    if int4 is not None and int4.gathers(part, _dtype(f, stored)):
                        pending.setdefault(prefix, {})[part] = f.get_tensor(stored)
                        continue
                    if gpt_oss.is_experts_tensor(name) or STACKED.match(name):
                        # every expert in one tensor a layer (gpt-oss's, GraniteMoE's)
                        value = f.get_tensor(stored)
                        if STACKED.match(name):
                            cut = [(p, v.contiguous()) for p, v in cut_stacked(name, value)]
                        else:
                            cut = experts.add(name, value)
                        for part, value in cut:
                            targets.wants(part)  # raises for a layer the model does not have
                            if tp is not None:  # cut per expert, then each rank's share
                                value = shard(part, value, model.spec, tp)
                            targets.place(part, value)
                            bar.update(1)
                        continue
                    if fused_parts(name):  # cut into its parts; each rank then takes its share
                        for part, rows in split_fused(name, f.get_tensor(stored), model.spec):
                            targets.wants(part)  # raises for a layer the model does not have
                            if tp is not None:
                                rows = shard(part, rows, model.spec, tp)
                            targets.place(part, rows)
                            bar.update(1)
                        continue
                    if not targets.wants(name):
                        continue
                    if tp is None:
                        tensor = f.get_tensor(stored)
                    else:
                        tensor = shard(name, f.get_slice(stored), model.spec, tp)
                    targets.place(name, tensor)
                    bar.update(1)
            # a layer whose parts are all read (its g_idx, if in a later file, goes unchecked)
            for prefix in [p for p, parts in pending.items() if int4.complete(p, parts)]:
                parts = pending.pop(prefix)
                name = prefix + ".weight"
                targets.wants(name)  # raises for a layer the model does not have
                value = int4.make(name, parts)  # then this rank's share, as of a GGUF tensor
                targets.place(name, value if tp is None else shard(name, value, model.spec, tp))
                bar.update(1)
    for prefix, parts in pending.items():
        if set(parts) - {"g_idx"}:
            raise CheckpointError(f"{prefix}: incomplete {int4.method} layer: {sorted(parts)}")
    experts.check_complete()
    if score is not None:
        targets.place("score.weight", score.head())
    targets.check_complete()


def load_gguf_weights(model: DecoderForCausalLM, ckpt: GgufCheckpoint) -> None:
    """Every weight from the file; under tensor parallelism this rank's part of each, cut out
    of the memory map as gpu/dist/parallel.py `shard` cuts a float tensor (block formats by
    whole rows and whole blocks)."""
    targets = Targets(model)
    tp = model.tp
    for name, value in ckpt.weights():
        parts = split_fused(name, value, model.spec) if fused_parts(name) else [(name, value)]
        for part, rows in parts:
            if targets.wants(part):
                targets.place(part, rows if tp is None else shard(part, rows, model.spec, tp))
    targets.check_complete()


def load_model(
    path: Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    backend,
    tp: TensorParallel | None = None,
) -> DecoderForCausalLM:
    """The model built on `backend` (gpu/backend.py), its weights read and prepared: in `dtype`
    (the checkpoint's or --dtype) unless the backend keeps them as the checkpoint holds them."""
    spec = ModelSpec.from_hf_config(config)
    compute = backend.bind(device, dtype)
    with torch.device("meta"):
        model = DecoderForCausalLM(spec, backend, tp)
    model = model.to(compute).to_empty(device=device)
    factors = None
    if is_gguf(path):
        ckpt = GgufCheckpoint(path)
        load_gguf_weights(model, ckpt)
        factors = ckpt.rope_factors()
        ckpt.close()
    else:
        text_only = getattr(config, "weir_text_of", None) is not None
        load_weights(model, path, int4_scheme(path, config), text_only)
    model.prepare()
    model.rope = Rope(config, spec.head_dim, device, factors, spec.rotary_dim)
    if spec.nope_layers:  # SmolLM3's layers without rotation: every angle 0
        model.rope_local = Rope.unturned(spec.head_dim, device)
    elif any(layer.local_rope for layer in model.model.layers):
        model.rope_local = Rope(
            config, spec.head_dim, device, None, spec.rotary_dim, "sliding_attention"
        )
    return model.eval()


def eos_token_ids(path: Path, config: Any) -> set[int]:
    """EOS ids from the config and from generation_config.json (which may list several)."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(x for x in v if isinstance(x, int))

    add(getattr(config, "eos_token_id", None))
    gen = path / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return ids
