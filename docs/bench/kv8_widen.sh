#!/usr/bin/env bash
# 8-bit K/V widening (issue 43 item 4, INFERGRAFT_KV8_WIDEN; kernels/kv8.py) on one GPU:
#   bash docs/bench/kv8_widen.sh OUT_DIR [attn] [e2e] [cvt] [tests]
# attn: one layer's decode attention (LLaMA-2-7B: 32/32 heads, D 128, batch 16 x 4,032) over
# bf16, int8 and e4m3 K/V, each 8-bit format under every widen mode and a few plans, beside
# the copy-rate roofline; it names the mode with the least int8 + e4m3 time. e2e: infergraft
# bench at batch 16 x 4,000 + 32 (LLaMA-2-7B shape) with kv-fp8 and kv-int8 beside bf16 K/V
# in one run, under that mode (or MODE=...). cvt: the same under the shipped cvt (the
# before). tests: the 8-bit attention tests on CUDA (the inline assembly in the dots).
set -u
OUT=${1:?OUT_DIR}
shift
PARTS=${*:-attn e2e}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
ig() { python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())' "$@"; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
e2e() {  # $1: widen mode
  INFERGRAFT_KV8_WIDEN=$1 ig bench --model llama2-7b --batches 16 --prompt-len 4000 \
    --new-tokens 32 --systems infergraft --compare-plugins kv-fp8,kv-int8 \
    --out "$OUT/e2e-$1" > "$OUT/e2e-$1.txt" 2>&1
  echo "== e2e, INFERGRAFT_KV8_WIDEN=$1"; tail -8 "$OUT/e2e-$1.txt"
}
if has tests; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    tests/kernel_tests/test_kv8_widen.py -k cuda > "$OUT/gpu_tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -12
fi
if has attn; then
  python3 docs/bench/kv_quant_attention.py --best-mode-out "$OUT/best_mode" \
    ${ATTN_ARGS:-} > "$OUT/attn.txt" 2>&1
  cat "$OUT/attn.txt"
fi
MODE=${MODE:-$(cat "$OUT/best_mode" 2>/dev/null || echo words16)}
if has e2e; then e2e "$MODE"; fi
if has cvt; then e2e cvt; fi
