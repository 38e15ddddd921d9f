"""--tensor-parallel-size over a GGUF file (gpu/loader.py load_gguf_weights, gpu/dist/parallel.py
_shard_blocks): each rank cuts its part out of the file's memory map as it cuts a float tensor,
a block format by whole rows (Q/K/V, gate/up, the vocabulary's share padded with zero rows) and
whole blocks of columns (O, down), nothing requantized; a cut through a block is refused."""

from __future__ import annotations

import pytest
import torch

from gpu.quant.gguf_write import q4_k_m, uniform
from tests.test_gguf import TEXT, close_to_transformers, hf_from_gguf, load_file, run, write_files

FILES = {
    ("qwen2", "f32"): uniform("f32"),
    ("llama", "q8_0"): uniform("q8_0"),
    ("llama", "q4_k_m"): q4_k_m,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """tests/test_gguf.py's models, only the files written here."""
    return write_files(tmp_path_factory.mktemp("gguf-tp"), FILES)


def test_an_f32_file_on_two_ranks_is_transformers_exactly(files):
    """Qwen2: Q/K/V biases cut with their rows, O's bias kept by rank 0, tied embeddings and a
    vocabulary cut in two."""
    hf, paths = files
    loaded = load_file(paths["qwen2", "f32"], tensor_parallel_size=2)
    try:
        assert len(loaded.core.runner.workers) == 2
        ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)[:20]
        got, _ = run(loaded, ids)
    finally:
        loaded.core.close()
    ref = hf_from_gguf(paths["qwen2", "f32"], hf["qwen2"])
    want = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got == want[0, len(ids) :].tolist()


def test_a_block_file_on_two_ranks_meets_the_one_rank_bar(files):
    """Llama in Q8_0 throughout (its embeddings too: the vocabulary's rows of blocks cut, the
    last rank's share padded with zero blocks): transformers over the dequantized weights,
    teacher-forced, as one rank is held to it (tests/test_gguf.py)."""
    hf, paths = files
    close_to_transformers(paths["llama", "q8_0"], hf["llama"], tensor_parallel_size=2)


def test_a_cut_through_a_block_is_refused_naming_the_tensor(files):
    """Q4_K_M's super-blocks hold 256 weights: O's 256 columns over two ranks would cut them."""
    _, paths = files
    with pytest.raises(Exception, match=r"o_proj.weight: columns \[0, 128\) are not whole"):
        load_file(paths["llama", "q4_k_m"], tensor_parallel_size=2)
