"""Model loading: sharded checkpoints, dtypes, tied and untied heads, rope scaling, bad paths."""

from __future__ import annotations

import json

import pytest
import torch

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load
from gpu.loader import eos_token_ids, load_config, resolve_model_path, weight_files
from tests.conftest import transformers_greedy


def greedy(loaded, ids, n=8):
    core = loaded.core
    core.add(EngineRequest("r", ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    out = []
    while core.has_work:
        for o in core.step():
            out += o.new_token_ids
    return out


def hf_greedy(path, ids, n=8):
    return transformers_greedy(path, [ids], n)[0]


def test_sharded_checkpoint_loads_and_matches(model_dir):
    path = model_dir("llama", shard_bytes="40KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(weight_files(path)) > 1
    loaded = load(EngineConfig(model=str(path), num_kv_blocks=32))
    ids = loaded.tokenizer.encode("the river flows over the stone")
    assert greedy(loaded, ids) == hf_greedy(path, ids)


def test_untied_head_and_llama3_rope_scaling(model_dir):
    path = model_dir(
        "llama",
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert not load_config(path).tie_word_embeddings
    loaded = load(EngineConfig(model=str(path), num_kv_blocks=32))
    assert hasattr(loaded.core.runner.model, "lm_head")
    ids = loaded.tokenizer.encode("token " * 30)  # long enough for the scaled band to matter
    assert greedy(loaded, ids) == hf_greedy(path, ids)


def test_max_model_len_past_the_models_positions_is_refused(model_dir, monkeypatch):
    """As vLLM: --max-model-len beyond the positions the model serves (rope scaling included) is
    a start-up error unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; the KV cache still cuts it."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    path = model_dir("llama", max_position_embeddings=512)
    with pytest.raises(CheckpointError, match="--max-model-len 1024 is more than the model's 512"):
        load(EngineConfig(model=str(path), num_kv_blocks=128, max_model_len=1024))
    assert load(EngineConfig(model=str(path), num_kv_blocks=128)).max_model_len == 512
    # a cache too small for it: the model's own length is cut to the cache, one asked for is
    # refused (as vLLM refuses it; it had been cut without a word but a warning)
    assert load(EngineConfig(model=str(path), num_kv_blocks=10)).max_model_len == 160
    with pytest.raises(CheckpointError, match="more than the KV cache holds .* 160 tokens"):
        load(EngineConfig(model=str(path), num_kv_blocks=10, max_model_len=400))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    long = load(EngineConfig(model=str(path), num_kv_blocks=128, max_model_len=1024))
    assert long.max_model_len == 1024
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    # yarn serves its original length times its factor
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    path = model_dir("qwen2", max_position_embeddings=256, rope_scaling=yarn)
    assert load(EngineConfig(model=str(path), num_kv_blocks=128)).max_model_len == 1024


def test_older_rope_theta_config_is_read(model_dir, tmp_path):
    import shutil

    src = model_dir("qwen2")
    dst = tmp_path / "old"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    (dst / "config.json").write_text(json.dumps(cfg))
    loaded = load(EngineConfig(model=str(dst), num_kv_blocks=32))
    ids = loaded.tokenizer.encode("hello world")
    assert greedy(loaded, ids) == hf_greedy(src, ids)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_dtypes_run(model_dir, dtype):
    loaded = load(
        EngineConfig(model=str(model_dir("qwen3")), dtype=dtype, num_kv_blocks=32, device="cpu")
    )
    model = loaded.core.runner.model
    # weir's CPU kernels hold the weights in 16 bits (activations float32), the cache too
    fmt = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    assert model.model.embed_tokens.w.fmt.name == fmt
    assert loaded.core.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    norms = sum(p.numel() * 4 for p in model.parameters())
    assert loaded.weight_bytes.get("f32", 0) == norms and loaded.weight_bytes[fmt] > 10 * norms
    out = greedy(loaded, loaded.tokenizer.encode("hello world"))
    assert len(out) == 8 and all(0 <= t < loaded.core.runner.vocab_size for t in out)


def test_eos_ids_come_from_config_and_generation_config(model_dir, tmp_path):
    path = model_dir("qwen3")
    im_end = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert eos_token_ids(path, load_config(path)) == {im_end}


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="could not find model"):
        resolve_model_path("no-such-org-weir/no-such-model")


def test_mistral_sliding_window_matches_transformers(model_dir):
    path = model_dir("mistral", sliding_window=8)
    for backend in ("torch", "triton"):
        loaded = load(
            EngineConfig(model=str(path), num_kv_blocks=32, block_size=4, attention_backend=backend)
        )
        assert loaded.core.runner.model.spec.sliding_window == 8
        ids = loaded.tokenizer.encode("the river flows over the stone and under the bridge")
        assert len(ids) > 8  # long enough that the window cuts
        assert greedy(loaded, ids, 12) == hf_greedy(path, ids, 12)


def test_padded_vocabulary_rows_zeroed_keep_greedy_on_text_tokens(model_dir):
    """A benchmark model padded past its tokenizer (Qwen's 151,936 rows) with those rows zeroed:
    the matrix products keep their size, greedy only ever picks tokens that have text (so a
    stream's TTFT and ITL count every token), and weir still equals transformers."""
    path = model_dir("qwen3", model_vocab_size=4096, zero_padding_rows=True)
    loaded = load(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64))
    assert loaded.core.runner.vocab_size == 4096
    text_tokens = len(loaded.tokenizer.get_vocab())
    assert text_tokens < 4096
    ids = loaded.tokenizer.encode("the river turns the mill wheel")
    got = greedy(loaded, ids, 24)
    assert got == hf_greedy(path, ids, 24)
    assert all(t < text_tokens for t in got)
