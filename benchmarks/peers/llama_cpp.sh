#!/usr/bin/env bash
# llama.cpp's own HTTP server (llama-server) as a serving baseline: what a CPU user would run.
#   benchmarks/peers/llama_cpp.sh install           build llama-server and a converter venv (once;
#                                                   ~18 min on 2 cores)
#   benchmarks/peers/llama_cpp.sh serve MODEL PORT  convert a local HF directory to a GGUF
#                                                   (cached) and serve it on 127.0.0.1:PORT
#                                                   (extra args go to llama-server)
#   benchmarks/peers/llama_cpp.sh gguf MODEL        convert only; print the GGUF's path
#   benchmarks/peers/llama_cpp.sh serve-file GGUF PORT [NAME]  serve a GGUF file as it is
# LLAMA_CPP_QUANT picks the format: f32 (default), f16, bf16, q8_0 (written by llama.cpp's
# convert_hf_to_gguf.py), or any type llama-quantize takes (q4_k_m, q5_k_m, q4_0, ...: quantized
# by llama-quantize from the BF16 file). The i-quants that need an importance matrix (iq1_*,
# iq2_*, iq3_xxs) take LLAMA_CPP_IMATRIX, else a uniform one (every column alike: rounding as
# without one, which is what a random benchmark model calls for).
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist (the package index is
# reachable here, GitHub is not). Three things differ from a plain build:
# - llama-server drops a keep-alive connection after every streamed response (its stream
#   provider returns false once the sink is done, which cpp-httplib reads as a cancelled write);
#   a client that reuses the connection at once then fails now and then. Patched to return true.
# - The converter rejects a freshly trained ByteLevel BPE tokenizer (its pre-tokenizer hash is
#   unknown); a plain ByteLevel split is mapped to "gpt-2", which tokenizes as HF does.
# - 64 slots of 512 tokens each (LLAMA_CPP_SLOTS, LLAMA_CPP_SLOT_CTX), continuous batching, the
#   model's chat template (--jinja), every core for both prompt and generation.
# llama.cpp stops on any token spelled <|endoftext|> even when the model does not list it as an
# EOS (give the benchmark model that as a second EOS), and keeps a prompt cache: start a fresh
# server for every round. LLAMA_CPP_HOME: where it is built (default .peers/llama-cpp).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
H=${LLAMA_CPP_HOME:-$HERE/.peers/llama-cpp}
VER=0.3.36
SRC=$H/llama_cpp_python-$VER/vendor/llama.cpp
BIN=$H/build/bin/llama-server
case "${1:-}" in
  install)
    mkdir -p "$H"
    [ -f "$H/llama_cpp_python-$VER.tar.gz" ] ||
      pip download -q --no-binary :all: --no-deps -d "$H" "llama-cpp-python==$VER"
    [ -d "$SRC" ] || tar -xzf "$H/llama_cpp_python-$VER.tar.gz" -C "$H"
    http=$SRC/tools/server/server-http.cpp
    if grep -q 'return has_next;' "$http"; then
      sed -i '/sink.done();/,/return has_next;/s/return has_next;/return true;/' "$http"
    fi
    # nothing remote (no OpenSSL, no downloaded web UI), the server target only
    [ -f "$H/build/build.ninja" ] ||
      cmake -S "$SRC" -B "$H/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    cmake --build "$H/build" --target llama-server llama-quantize -j "$(nproc)" | tail -1
    if [ ! -f "$H/venv/.done" ]; then
      # the converter imports torch and transformers (tokenizer), and sentencepiece on its Llama
      # path; gguf-py from the same tree, so its constants match the binary
      python3 -m venv "$H/venv"
      "$H/venv/bin/pip" install -q torch==2.13.0 numpy transformers sentencepiece "$SRC/gguf-py"
      touch "$H/venv/.done"
    fi
    "$BIN" --version 2>&1 | head -1
    ;;
  gguf)
    [ -x "$BIN" ] && [ -x "$H/build/bin/llama-quantize" ] && [ -f "$H/venv/.done" ] || "$0" install >&2
    model=$(realpath "$2")
    quant=$(printf %s "${LLAMA_CPP_QUANT:-f32}" | tr 'A-Z' 'a-z')
    case $quant in f32|f16|bf16|q8_0) outtype=$quant ;; *) outtype=bf16 ;; esac
    mkdir -p "$H/gguf"
    base=$H/gguf/$(printf %s "$model" | sha1sum | cut -c1-12)-$(basename "$model")
    gguf=$base-$outtype.gguf
    if [ ! -f "$gguf" ] || [ -n "$(find "$model" -type f -newer "$gguf" | head -1)" ]; then
      "$H/venv/bin/python" - "$SRC" "$model" --outtype "$outtype" --outfile "$gguf.$$" >&2 <<'EOF'
import json, runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion.base import TextModel

known = TextModel.get_vocab_base_pre

def vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        pre = json.load(open(self.dir_model / "tokenizer.json")).get("pre_tokenizer") or {}
        plain = pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space")
        if not plain or not pre.get("use_regex", True):
            raise
        print("llama_cpp.sh: unknown pre-tokenizer hash, plain ByteLevel -> gpt-2", file=sys.stderr)
        return "gpt-2"

TextModel.get_vocab_base_pre = vocab_base_pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
      mv "$gguf.$$" "$gguf"
    fi
    if [ "$outtype" != "$quant" ]; then
      out=$base-$quant.gguf
      if [ ! -f "$out" ] || [ "$gguf" -nt "$out" ]; then
        imatrix=()
        case $quant in iq1_*|iq2_*|iq3_xxs)  # llama-quantize needs an importance matrix
          imatrix=(--imatrix "${LLAMA_CPP_IMATRIX:-$base-uniform.imatrix}")
          [ -n "${LLAMA_CPP_IMATRIX:-}" ] || "$H/venv/bin/python" - "$SRC" "$gguf" "${imatrix[1]}" <<'IMATRIX'
import struct, sys
sys.path[:0] = [sys.argv[1] + "/gguf-py"]
import gguf
# every input column of every block matrix equally important: rounded as without a matrix
entries = [(t.name, int(t.shape[0])) for t in gguf.GGUFReader(sys.argv[2]).tensors
           if len(t.shape) == 2 and t.name.startswith("blk.")]
with open(sys.argv[3], "wb") as f:  # llama.cpp's legacy .dat layout
    f.write(struct.pack("<i", len(entries)))
    for name, n in entries:
        f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, n))
        f.write(struct.pack(f"<{n}f", *([1.0] * n)))
    f.write(struct.pack("<ii", 1, 7) + b"uniform")
IMATRIX
          ;;
        esac
        "$H/build/bin/llama-quantize" ${imatrix[@]+"${imatrix[@]}"} "$gguf" "$out.$$" "$quant" "$(nproc)" >&2
        mv "$out.$$" "$out"
      fi
      gguf=$out
    fi
    echo "$gguf"
    ;;
  serve)
    name=$2; port=$3; shift 3
    gguf=$("$0" gguf "$name")
    exec "$0" serve-file "$gguf" "$port" "$name" "$@"
    ;;
  serve-file)
    [ -x "$BIN" ] || "$0" install >&2
    gguf=$2; port=$3; name=${4:-$2}; shift $(( $# < 4 ? $# : 4 ))
    slots=${LLAMA_CPP_SLOTS:-64}; slot_ctx=${LLAMA_CPP_SLOT_CTX:-512}
    exec "$BIN" -m "$gguf" -a "$name" --host 127.0.0.1 --port "$port" -t "$(nproc)" \
      -tb "$(nproc)" -np "$slots" -c $((slots * slot_ctx)) -cb --jinja --no-webui "$@"
    ;;
  *) sed -n '2,24p' "$0"; exit 2 ;;
esac
