"""What a quantized GGUF file's serving is held to in the tests: transformers on the `gguf`
package's own dequantization of the file, and weir's first-ranked token after each position of
a prompt."""

from __future__ import annotations

import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load


def prompt_choices(path, ids: list[int], **config) -> list[int]:
    """weir's first-ranked token after each of the prompt's positions (its prompt log-probs)."""
    config = {"device": "cpu", "num_kv_blocks": 64} | config
    core = load(EngineConfig(model=str(path), **config)).core
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    core.add(EngineRequest("r", ids, params))
    plp = None
    while core.has_work:
        for o in core.step():
            plp = o.prompt_logprobs or plp
    return [plp[i].top_ids[0] for i in range(1, len(ids))]


# the architectures whose checkpoints name tensors otherwise than weir (gpu/models/renames.py)
OWN_NAMES = {
    "starcoder2": ((".mlp.up_proj.", ".mlp.c_fc."), (".mlp.down_proj.", ".mlp.c_proj.")),
    "phi2": (
        (".self_attn.o_proj.", ".self_attn.dense."),
        (".mlp.up_proj.", ".mlp.fc1."),
        (".mlp.down_proj.", ".mlp.fc2."),
        ("model.norm.", "model.final_layernorm."),
    ),
    "apertus": (
        (".input_layernorm.", ".attention_layernorm."),
        (".post_attention_layernorm.", ".feedforward_layernorm."),
    ),
}


def dequantized(path, hf_dir, out):
    """A Hugging Face directory of `hf_dir`'s config holding the GGUF file's weights as the `gguf`
    package dequantizes them (experts unstacked, Llama's Q/K rows back in Hugging Face's order):
    the reference a quantized file's serving is held to. GraniteMoE's in its own names: its
    experts stacked, gate and up joined (input_linear), its router `router.layer`; Gemma's and
    Nemotron's norm weights less the 1 the file adds; StarCoder2's and Phi-2's own names."""
    import shutil

    import gguf
    import numpy as np
    from safetensors.torch import save_file

    from gpu.gguf_names import PERMUTED, expert_name, hf_name, llama_unpermute_index

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    heads = reader.fields[f"{arch}.attention.head_count"].contents()
    kv_heads = reader.fields[f"{arch}.attention.head_count_kv"].contents()
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = torch.from_numpy(w.reshape([int(d) for d in reversed(t.shape)]))
        name = hf_name(t.name, arch)
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            w = w[torch.from_numpy(llama_unpermute_index(w.shape[0], n))]
        if arch in ("gemma", "gemma2", "gemma3", "nemotron") and name.endswith("norm.weight"):
            w = w - 1.0  # the file holds 1 + w (llama.cpp's converter adds the 1)
        for weirs, own in OWN_NAMES.get(arch, ()):  # (StarCoder2's MLP, Phi-2's)
            name = name.replace(weirs, own)
        if arch == "granitemoe":  # GraniteMoE's names: its router, its experts stacked
            name = name.replace(".mlp.gate.", ".block_sparse_moe.router.layer.")
        if w.dim() == 3 and arch == "granitemoe":
            state[name] = w.contiguous()  # (gate and up joined below)
        elif w.dim() == 3:
            state.update({expert_name(name, e): w[e].contiguous() for e in range(w.shape[0])})
        else:
            state[name] = w.contiguous()
    if arch == "apertus":  # its xIELU parameters: the file's metadata, a value a layer
        for key, shape in (("alpha_p", [1]), ("alpha_n", [1]), ("beta", []), ("eps", [])):
            for i, v in enumerate(reader.fields[f"xielu.{key}"].contents()):
                state[f"model.layers.{i}.mlp.act_fn.{key}"] = torch.tensor(v).reshape(shape)
    for gate in [n for n in state if n.endswith(".mlp.experts.gate_proj.weight")]:
        if arch != "granitemoe":
            break
        layer = gate.removesuffix(".mlp.experts.gate_proj.weight")
        up = state.pop(f"{layer}.mlp.experts.up_proj.weight")
        joined = torch.cat([state.pop(gate), up], dim=1)
        state[f"{layer}.block_sparse_moe.input_linear.weight"] = joined
        down = state.pop(f"{layer}.mlp.experts.down_proj.weight")
        state[f"{layer}.block_sparse_moe.output_linear.weight"] = down
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(state, str(out / "model.safetensors"))
    return out


def assert_near_dequantized(path, hf_dir, out, ids: list[int]) -> None:
    """A quantized file served by weir against transformers on the `gguf` package's
    dequantization of it (`dequantized`, written to `out`): at each of the prompt's positions
    the token weir ranks first is transformers' first in at least 80% of them, and within 0.1 of
    it in log-probability on average (weir's kernels round the activations to 8 bits, as
    llama.cpp's do)."""
    from transformers import AutoModelForCausalLM

    ref = dequantized(path, hf_dir, out)
    ours = torch.tensor(prompt_choices(path, ids))
    model, info = AutoModelForCausalLM.from_pretrained(
        ref, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]  # (else the reference is random)
    model.eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    agree = int((logprobs.argmax(-1) == ours).sum())
    assert agree >= 0.8 * len(ours), (agree, len(ours))
    gaps = logprobs.max(-1).values - logprobs[torch.arange(len(ours)), ours]
    assert float(gaps.mean()) < 0.1, gaps
