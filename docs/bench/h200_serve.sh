#!/usr/bin/env bash
# The serving figures of docs/BENCHMARKS.md on one H200, in one device call:
#   bash docs/bench/h200_serve.sh OUT_DIR
# (the wheels of fastapi, uvicorn and their dependencies in .whl/, see the device README).
# 1) the serving and sampling tests on the GPU (SKIP_TESTS=1: not); 2) a random
# LLaMA-3-8B-shaped directory (save_pretrained, bf16, no tokenizer); 3) infergraft serve on
# it and infergraft bench serve against it: a rate sweep (inf, 32 and 8 requests/s), then
# the rate-inf requests through our offline engine and through HF's continuous batching
# (SKIP_HF=1: not), in the same run; 4) with PREFILL_GRAPHS=1, a server with prefill
# graphs at rate inf.
set -u
OUT=${1:?OUT_DIR}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
MODEL=/tmp/llama3-8b
ig() { python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())' "$@"; }
TESTS=
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the benchmark only
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_sampling_params.py \
    tests/test_logits_processing.py tests/test_async_engine.py tests/test_engine_threads.py \
    tests/test_engine_process.py > "$OUT/gpu_tests.txt" 2>&1 &
  TESTS=$!
fi
python3 - "$MODEL" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from infergraft.core.tools.bench_cli import SHAPES
cfg = LlamaConfig(**SHAPES["llama3-8b"], rms_norm_eps=1e-5, tie_word_embeddings=False)
cfg.architectures = ["LlamaForCausalLM"]
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
PY
[ -n "$TESTS" ] && { wait $TESTS; tail -3 "$OUT/gpu_tests.txt"; }
# serve_and_bench NAME "SERVER FLAGS" "BENCH FLAGS": one server, one bench serve, then
# SIGTERM (the server's exit status is printed)
serve_and_bench() {
  # (python3 itself in the background, not a shell function, so that $! is the server)
  python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())' serve \
    --model "$MODEL" --plugin paged --max-batch-size 64 --max-seq-len 1024 --port 8000 $2 \
    > "$OUT/server-$1.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf 127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  echo "[$1] server up after $SECONDS s"
  ig bench serve --base-url http://127.0.0.1:8000 --dataset fixed --prompt-len 512 \
    --output-len 256 --num-prompts 192 $3 --out "$OUT/$1" > "$OUT/bench-$1.txt" 2>&1
  grep -E "^rate|Output token|P50 TPOT|P50 ITL|P99 TTFT|offline|HF" "$OUT/bench-$1.txt"
  curl -s 127.0.0.1:8000/metrics | grep -E "^infergraft_(engine|requests_|generation|request_success)" \
    > "$OUT/metrics-$1.txt"
  kill -TERM $server; wait $server; echo "[$1] server exit $?"
}
OFFLINE="--offline-model $MODEL --offline-plugin paged --offline-max-batch-size 64 --offline-dtype bfloat16"
# the default server: a rate sweep, then the rate-inf requests through our offline engine
# (and HF's continuous batching unless SKIP_HF=1)
HF=--offline-hf; [ -n "${SKIP_HF:-}" ] && HF=
serve_and_bench serve "" "--sweep-rates inf,32,8 $OFFLINE $HF"
# with prefill graphs (a lone prompt's prefill replayed alone), at rate inf
[ -n "${PREFILL_GRAPHS:-}" ] && serve_and_bench prefill-graphs "--prefill-graphs" "--request-rate inf"
true
